"""The reference trainer, also saving reshard's native format at every save point.

    mpirun ... .venv/bin/python -m integration.megatron_deepspeed.train_reshard \\
        --save-native /ckpt/native [--no-deepspeed-save] <train.py arguments>

Each time train.py saves (every --save-interval iterations and at the end; --save must be given),
the live engine is also written as NATIVE_ROOT/step-<iteration> (reshard_hook.reshard_save), so a
later run at any layout can resume with --load-with reshard --load NATIVE_ROOT (or a
configs/resume/*.yaml). With --no-deepspeed-save only the native checkpoint is written.
"""

from __future__ import annotations

import argparse
import sys

from . import train


def install(save_native: str, deepspeed_save: bool = True):
    """Makes train.save_checkpoint also write the native format under `save_native`."""
    original = train.save_checkpoint

    def save_checkpoint(engine, cfg, args, iteration, consumed, uc_info, no_pipeline):
        import torch.distributed as dist
        from .reshard_hook import reshard_save
        if deepspeed_save:
            original(engine, cfg, args, iteration, consumed, uc_info, no_pipeline)
        reshard_save(engine, args, save_native, f"step-{iteration}", iteration, consumed)
        dist.barrier()

    train.save_checkpoint = save_checkpoint


def parse(argv):
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--save-native", default=None)
    p.add_argument("--no-deepspeed-save", action="store_true")
    return p.parse_known_args(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = parse(argv)
    if not ours.save_native:
        raise SystemExit("train_reshard: --save-native DIR is required")
    install(ours.save_native, not ours.no_deepspeed_save)
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())
