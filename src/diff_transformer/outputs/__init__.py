"""Output directories that never cost the user data: `convert`, `demo`, `train`, `merge` and `niah` all choose and
write them here, in three layers (each imports only the ones above it):

* `files`: where a command may write (`check_target`), and how: never through a link (`write_new_file`,
  `refuse_links`); `OutputError`, and the names of this package's bookkeeping entries.
* `records`: proofs that a command wrote what a directory holds: the manifest of an output written whole
  (`write_manifest` / `wrote_this`) and the run record of a training run's --output (`record_written`,
  `record_entry`, `remove_recorded`, ...).
* `staging`: staging an output beside OUT and installing it whole (`Staging`), the locks of live runs and the
  recovery of dead ones (`recover`), one run at a time into an output written in place (`OutputLock`), and what of a
  replaced OUT --overwrite may remove: only what a command of this package provably wrote (`ours`); the rest is the
  user's (`users_entries`), kept, or the command is refused naming it.
"""
