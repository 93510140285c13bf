"""The torch.distributed runtime: the only part of dynmb that uses ``torch.distributed``.

Import-light on purpose: ``import dynmb.runtime`` loads nothing heavy; import the
submodules where they are needed. From the job down to one message:

- ``spec``: ``RunSpec`` (one run: config, output, run id, checks) and ``JobSpec`` (the cases
  of one torchrun job), with their JSON form (``spec.json``).
- ``launch``: ``launch_job(job, nproc) -> LaunchResult``: a job through torchrun, naming the
  failed ranks (``api.run``, i.e. ``dynmb.run``, builds the job from configs); ``processes``: stop signals and stopping
  torchrun's process tree.
- ``worker``: the torchrun entry point (``python -m torch.distributed.run --standalone
  --nproc-per-node P -m dynmb.runtime.worker --spec SPEC``) and its loop over cases and steps.
- ``topology``: ranks, pair / data-parallel / pipeline process groups.
- ``state``: what a run keeps on a rank across steps (stages, optimizer, models, planning).
- ``step``: one optimizer step (plan, actions, gradient all-reduce, Adam, measurements).
- ``checks``: plan digest agreement, the memory limit, ``--verify`` reference gradients.
- ``records``: the rows of the steps/actions/memory/runs tables rank 0 writes.
- ``hooks``: the points of a step tests act on (fault injection), ``NoHooks`` otherwise.
- ``interpreter``: one rank's actions of a schedule; ``comm``: P2P with shapes from the plan.
- ``device``: the device seam (clock, synchronize, allocator peaks, empty cache, binding a GPU):
  the only module of the runtime that calls ``torch.cuda``.
- ``meter``: per-stage peak memory; ``hostmem``: the CPU allocator policy.
- ``trace``: ``export_trace(actions_df, path, step=None)``: Chrome/Perfetto JSON of a step.

Measurements (stage times, the memory grid, the P2P ping-pong) live in ``dynmb.measure``.
"""

__all__ = ["spec", "launch", "processes", "worker", "topology", "state", "step", "checks", "records", "hooks",
           "interpreter", "comm", "device", "meter", "hostmem", "trace"]
