"""The experiment kit the reproductions share (built on the trainer of :mod:`rankwise.train.finetune`):

* :mod:`rankwise.repro.kit.cached_encoder`: a frozen encoder prefix run once and cached, the adapted top
  layers trained on its outputs, lock-step training of several models on the same batches;
* :mod:`rankwise.repro.kit.task_loras`: task LoRAs on the embedded MiniLM, trained once per (task, seed)
  by a fixed recipe and cached (the merging reproductions' inputs).

They lived in ``rankwise.zoo`` before; ``zoo`` holds only models and data and imports only ``core``.
"""
