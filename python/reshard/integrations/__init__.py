"""Trainer integrations: each fills a live trainer's model and optimizer from a checkpoint saved
under any parallel layout.

* :mod:`reshard.integrations.megatron_deepspeed`: Megatron-DeepSpeed's trainer
  (``load_checkpoint``, a drop-in for megatron.checkpointing.load_checkpoint), its DeepSpeed engines
  (PipelineEngine, DeepSpeedEngine with ZeRO-0/1/2/3, BF16_Optimizer, fp16) through ``EngineView``.
"""
