"""Drop-ins for the trainers people use; each imports its framework only
when it is used (install the extra: ``polyak[lightning]``,
``polyak[transformers]``, ``polyak[accelerate]``).

- :mod:`polyak.integrations.lightning`: ``PolyakCallback``, a PyTorch
  Lightning callback.
- :mod:`polyak.integrations.transformers`: ``PolyakTrainerCallback``, a
  HuggingFace ``transformers`` ``TrainerCallback``.
- :mod:`polyak.integrations.accelerate`: ``PolyakAccelerate``, for loops
  written with ``accelerate``.

Every one of them pushes after each optimizer step (so gradient
accumulation pushes once per step, at the step the optimizer took), takes
a snapshot whenever the framework saves a checkpoint, and on a restart from
that checkpoint restores the EMA of that step with ``run.resume`` before
the first push: the EMA of a run killed and restarted is bit for bit that
of a run that never stopped.
"""
