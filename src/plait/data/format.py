"""The on-disk format of a prepared corpus: its manifest's file name and format tag (plait.data.prepare
writes it, plait.data.loader and plait.data.remote read it)."""

MANIFEST = "manifest.json"
FORMAT = "plait-tokens-v1"
