"""Retiring one committed step from outside the writer, as a framework's own deletion.

Lightning removes a checkpoint file, the HF Trainer deletes checkpoint directories at
the end of `train()`: where the file was only a pointer at a step, the step must go with
it, or the root keeps a step nobody names and a plain restore takes it. The writer's
retention cannot know; the integration retires the step itself: one atomic rename to
`step-N.retired` (its bytes stay readable while a kept step references them; the
writer deletes them at a later commit, or `asyncckpt gc` does), then `latest` pointed
anew when it named that step.
"""

from __future__ import annotations

from asyncckpt.storage.base import Storage
from asyncckpt.writer.commit import update_latest


def retire_committed(storage: Storage, step: int) -> bool:
    """Retire `step` of `storage` if it is committed, and point `latest` at the newest
    step left when it named `step` (or nothing).

    Returns:
        False when `step` was not committed (nothing done), else True.
    Raises:
        OSError: the rename or `latest`'s update failed (a failed update leaves a
            `latest` that readers check against the disk).
    """
    if step not in storage.committed_steps():
        return False
    named = storage.read_latest()
    storage.retire(step)
    if named == step or named is None:  # an older step's retirement leaves the newest,
        update_latest(storage)          # and `latest`, as they were
    return True
