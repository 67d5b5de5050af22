"""bench/startup.py: the moments it reports are those of a real ``asyncrl train``, in order."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow  # ~1 min of asyncrl processes; what the commands import: test_startup; a CLI run: test_cli
def test_the_moments_of_a_run_come_in_order_and_the_evaluation_before_the_first_step() -> None:
    result = run_bench("startup", "--repeats", "1", "--steps", "1", "--top", "5")[-1]
    assert set(result["commands"]) >= {
        "help",
        "config_docs",
        "bad_key",
        "import_torch",
        "import_transformers",
    }
    assert min(result["commands"].values()) > 0
    for variant in ("no_eval", "eval_at_start"):
        moments = result["train"][variant]
        order = ["config_validated", "run_started", "first_generation", "first_optimizer_step"]
        assert [moments[k] for k in order] == sorted(moments[k] for k in order), moments
        assert moments["config_validated"] > 0 and moments["step_1_recorded"] <= moments["exited"]
    assert result["train"]["no_eval"]["eval_s"] == 0 < result["train"]["eval_at_start"]["eval_s"]
    assert len(result["imports"]) == 5
    assert all(i["by"].startswith(("asyncrl", "(")) for i in result["imports"])
    assert "torch" in {i["module"] for i in result["imports"]}
