"""The core types and settings: microbatches, plans with their metadata, actions, schedules,
predictions, the settings records (``PlanSpec``, ``RunConfig``), ``ModelConfig`` and units. numpy only."""
