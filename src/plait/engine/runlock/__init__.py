"""One run per run directory: a lock beside the run directory (local disks, NFS, Lustre) and a lease object in
an ``s3://`` checkpoint directory, each naming its holder and kept fresh by a heartbeat.

Two jobs on one run directory (a command started twice, a Slurm job resubmitted while the first still runs)
would both train, interleave their metrics and overwrite each other's checkpoints, and both exit 0. The lock
refuses the second at once, before it writes anything, naming the holder and the way out.

Where: ``<run.out_dir>/<run.name>.lock`` (beside the run directory, so that run.overwrite can move the directory
aside while the lock stays held), and ``<checkpoint.dir>/run.lock`` when checkpoints live elsewhere (a local
directory, or an S3 prefix: a lease object).

How, on a file system: the lock is written whole to a temporary file and hard-linked to its name. link(2) is
atomic and fails on an existing name on local disks, NFS and Lustre alike (where O_EXCL and flock are not
dependable everywhere). The holder rewrites its heartbeat every HEARTBEAT_S (temporary file + rename) after
checking that the file is still its own. On S3: a conditional PUT (If-None-Match: *) creates the lease;
heartbeats and take-overs are PUTs conditional on the ETag read (If-Match), so two contenders cannot both win.

Stale: on the same machine (same host, boot and PID namespace) a lock whose process is gone, a zombie, or
whose PID now belongs to a younger process: taken over at once, with a warning. Elsewhere a heartbeat older
than LEASE_S (clocks across a cluster agree within seconds): taken over. A heartbeat that is late but not yet
expired is waited out (at most LEASE_S). The same job restarted by torchrun's elastic agent (the same rendezvous
id, a higher restart count) takes its lock over from its earlier attempt without a warning; `plait train
--nproc` holds the lock in its launcher across its restarts and hands it to its workers (PLAIT_RUN_LOCK).
``run.break_lock=true`` takes over a lock that still looks alive (after a warning naming its holder).

Fencing: a holder can lose its lock without knowing it yet (run.break_lock, or it was stopped or held up past
its lease and then went on). Its heartbeat notices within HEARTBEAT_S, but a save may end sooner: so every
publish re-reads the lock first (the lock's token is the fencing token; plait.core.publish.check_fence) and a
run whose lock was taken stops there with exit 2, publishing nothing more. A run that took the lock from a
holder that may still be running (break_lock, an expired lease, a stopped process) deletes none of its
unfinished files (plait.engine.checkpoint moves them aside and says so). A heartbeat from the future (the
holder's clock is ahead) is named as such, and the lock file's own age judges that holder instead.

Modules: ``holder`` (who holds a lock: identity, alive or not, description), ``backends`` (a lock file, an S3
lease), ``lock`` (RunLock: acquire, judge, heartbeat, fence, release).
"""

from plait.engine.runlock.holder import describe, holder_alive, identity
from plait.engine.runlock.lock import (
    HEARTBEAT_S,
    LATE_S,
    LEASE_S,
    LOCK_ENV,
    LOCK_FILE,
    RunLock,
    RunLocked,
    lock_places,
)

__all__ = [
    "HEARTBEAT_S", "LATE_S", "LEASE_S", "LOCK_ENV", "LOCK_FILE", "RunLock", "RunLocked", "describe", "holder_alive",
    "identity", "lock_places",
]  # fmt: skip
