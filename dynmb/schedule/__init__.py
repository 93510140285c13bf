"""Pipeline schedules: builders, validation, CSV/str I/O (pure Python).

``build_schedule(kind, num_stages, num_microbatches, ...)`` emits a
``dynmb.core.types.Schedule`` through the registry of kinds (``kinds``: each kind's builder and
traits; ``register_kind`` adds one); ``validate`` checks it; ``to_csv``/``from_csv`` speak
torch.distributed.pipelining's compute-only CSV. This package never imports the
simulator; reordering microbatches (scored by the simulator) is a planning pass,
``dynmb.planning.reorder``.
"""

from __future__ import annotations

from dynmb.schedule.builders import gpipe, interleaved, memory_aware, memory_windows, one_f_one_b
from dynmb.schedule.kinds import (SCHEDULE_KINDS, BuildInputs, ScheduleKind, build_schedule, get_kind, kind_names,
                                  register_kind)
from dynmb.schedule.io import from_csv, from_str, to_csv, to_str
from dynmb.schedule.validate import ScheduleError, execution_order, format_grid, validate

__all__ = ["SCHEDULE_KINDS", "build_schedule", "ScheduleKind", "BuildInputs", "register_kind", "get_kind", "kind_names", "gpipe", "one_f_one_b", "interleaved", "memory_aware",
           "memory_windows", "validate", "ScheduleError", "execution_order", "format_grid",
           "to_csv", "from_csv", "to_str", "from_str"]

