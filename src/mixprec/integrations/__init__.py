"""mixprec where users already train: each module plugs mixprec's recipes, loss scaler and step
into one framework through that framework's public extension points.

- ``mixprec.integrations.lightning``: ``MixprecPrecision``, a Lightning precision plugin
  (``L.Trainer(plugins=[MixprecPrecision("bf16-true")])``); ``pip install "mixprec[lightning]"``.
- ``mixprec.integrations.fabric``: ``MixprecFabricPrecision``, the same for Lightning Fabric
  (``L.Fabric(plugins=[MixprecFabricPrecision("fp16-mixed", device="cpu")])``; your loop).
- ``mixprec.integrations.transformers``: ``MixprecTrainer`` (and ``MixprecTrainerMixin``), the
  Hugging Face Trainer running a mixprec recipe; ``pip install "mixprec[transformers]"``.
- ``mixprec.integrations.records``: ``StepLog``, step records (loss, scale, skipped, grad norm)
  buffered on the device and read in batches, as dicts for W&B or MLflow; ``StepWindow``, their
  summary since the last log call.
- ``mixprec.integrations.tensorboard``: ``TensorBoardStepWriter``, those records as TensorBoard
  scalars; ``pip install "mixprec[tensorboard]"``.

Nothing in mixprec imports this package; importing it imports no framework (each module imports
its own). See docs/integrations.md.
"""
