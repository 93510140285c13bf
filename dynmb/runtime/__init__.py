"""The torch.distributed runtime: P2P with shapes from the plan, the action interpreter,
the torchrun worker, the launcher, memory metering and trace export.

Import-light on purpose: ``import dynmb.runtime`` loads nothing heavy; import the
submodules (``dynmb.runtime.launch``, ``.worker``, ``.interpreter``, ``.comm``,
``.trace``, ``.meter``) where they are needed.

- ``launch.launch(run_cfg, out_dir, nproc, verify=False) -> int``: run through torchrun.
- ``python -m torch.distributed.run --standalone --nproc-per-node P -m dynmb.runtime.worker --spec SPEC``.
- ``trace.export_trace(actions_df, path, step=None)``: Chrome/Perfetto JSON of a step.
"""

__all__ = ["comm", "interpreter", "worker", "launch", "trace", "meter"]
