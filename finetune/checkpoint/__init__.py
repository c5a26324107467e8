"""Checkpoints that survive kill -9: DeepSpeed state + data position + every rank's RNG, made visible atomically.

    path = save(engine, "runs/x", step=12, keep_last=2, meta={}); step = load(engine, find_latest("runs/x"))

layout.py: where checkpoints live and which are complete. store.py: writing one (every rank, atomically) and reading
it back. portable.py: the world-size-independent copy of the trained weights and Adam moments, for a resume on another
number of ranks or ZeRO stage. manifest.py: every file's size and checksum, written last and verified before a resume
or an export. space.py: the disk space a run's checkpoints need, checked before the first step.
"""

from finetune.checkpoint.layout import (ENGINE_TAG, MARKER, STEP_DIR, UNIVERSAL_TAG, checkpoints_dir,
                                        complete_checkpoints, find_latest, resolve_resume, saved_meta, saved_step,
                                        saved_world_size)
from finetune.checkpoint.space import (WRITE_PROBE, check_output_dir, checkpoints_to_fit, estimate_checkpoint_bytes,
                                       new_checkpoints_at_once, planned_saves)
from finetune.checkpoint.manifest import MANIFEST, verified_resume, verify, verify_on_ranks
from finetune.checkpoint.portable import data_position, resume_note, resume_route
from finetune.checkpoint.store import SaveError, load, prepare_reshard, save

__all__ = ["ENGINE_TAG", "MARKER", "STEP_DIR", "UNIVERSAL_TAG", "WRITE_PROBE", "SaveError", "check_output_dir",
           "checkpoints_dir", "checkpoints_to_fit", "complete_checkpoints", "estimate_checkpoint_bytes", "find_latest",
           "load", "new_checkpoints_at_once", "planned_saves", "prepare_reshard", "resolve_resume", "save",
           "saved_meta", "saved_step", "saved_world_size"]
__all__ += ["MANIFEST", "verified_resume", "verify", "verify_on_ranks"]
__all__ += ["data_position", "resume_note", "resume_route"]
