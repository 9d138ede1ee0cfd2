"""`reshard diff` against torch state-dict files: DeepSpeed's own zero_to_fp32 output (module names
mapped to canonical names) must equal reshard's consolidation of the same checkpoint, bitwise."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))
FIXTURES = Path(os.environ.get("RESHARD_DS_FIXTURES", ROOT / "build" / "ds_fixtures"))


def cases_with_zero_to_fp32():
    if not FIXTURES.is_dir():
        return []
    return sorted(p.parent.parent for p in FIXTURES.glob("*/reference/zero_to_fp32.pt"))


@pytest.mark.skipif(not CLI.exists(), reason="build/bin/reshard not built")
@pytest.mark.skipif(not cases_with_zero_to_fp32(), reason="no DeepSpeed fixtures (tests/fixtures/make_deepspeed_fixtures.sh)")
@pytest.mark.parametrize("case", cases_with_zero_to_fp32(), ids=lambda p: p.name)
def test_zero_to_fp32_output_equals_consolidated_fp32(case, tmp_path):
    ref = case / "reference" / "zero_to_fp32.pt"
    r = subprocess.run([str(CLI), "diff", str(case), str(ref), "--state", "fp32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert " 0 differ" in r.stdout
    # And a change is found: perturb one value in a copy of the reference.
    import torch
    sd = torch.load(ref, weights_only=False)
    inner = sd["module"] if isinstance(sd, dict) and isinstance(sd.get("module"), dict) else sd
    name = next(k for k, v in inner.items() if torch.is_tensor(v) and v.numel() > 1)
    inner[name] = inner[name].clone()
    inner[name].view(-1)[0] += 0.25
    bad = tmp_path / "tampered.pt"
    torch.save(sd, bad)
    r = subprocess.run([str(CLI), "diff", str(case), str(bad), "--state", "fp32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr
    assert "max |diff| 0.25" in r.stdout
