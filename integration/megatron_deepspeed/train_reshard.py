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


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--save-native", required=True)
    p.add_argument("--no-deepspeed-save", action="store_true")
    ours, rest = p.parse_known_args(argv)
    deepspeed_save = train.save_checkpoint

    def save_checkpoint(engine, cfg, args, iteration, consumed, uc_info, no_pipeline):
        import torch.distributed as dist
        from .reshard_hook import reshard_save
        if not ours.no_deepspeed_save:
            deepspeed_save(engine, cfg, args, iteration, consumed, uc_info, no_pipeline)
        reshard_save(engine, args, ours.save_native, f"step-{iteration}", iteration, consumed)
        dist.barrier()

    train.save_checkpoint = save_checkpoint
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())
