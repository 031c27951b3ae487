"""A hostile but fair user through the real entry point: config files that are not text,
numbers that are not finite or absurd, output places that cannot be written (a full disk
included), and messages shown as typed. Each ends as one line naming the path or field and
what to do, exit code 2 and nothing written; or as a finite, valid result."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from support import ok, one_line_error, rlsched, snapshot, unwritable_folder

from rlsched.config import load_preset_data

SMALL = ["--set", "rl.steps=1", "--set", "workload.prompts=8"]


def _refuse(constant: str):
    raise ValueError(f"not JSON: {constant}")


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are refused."""
    return json.loads(text, parse_constant=_refuse)


def refused(tmp_path: Path, *args: str, names=(), cwd: Path | None = None, **kw) -> str:
    """Run a command that must be refused: one line naming `names`, nothing written in tmp_path."""
    before = snapshot(tmp_path)
    line = one_line_error(rlsched(*args, cwd=cwd or tmp_path, **kw), *names)
    assert snapshot(tmp_path) == before, f"written: {snapshot(tmp_path) ^ before}"
    return line


# ----------------------------------------------------------------------------- configs that are not text

NOT_TEXT = {
    "binary": b"\xff\xfe\x00\x01\x89PNG\r\n\x1a\n",
    "latin-1": "name: café\nseed: 1\n".encode("latin-1"),
}
CONFIG_COMMANDS = {
    "simulate": ["simulate", *SMALL],
    "compare": ["compare", "--seeds", "1", "--workers", "1", "--out", "cmp"],
    "learn": ["learn", "--out", "policy.json"],
    "plan": ["plan", "--out", "planned"],
    "run": ["run", "--out", "run"],
}


@pytest.mark.parametrize("content", list(NOT_TEXT), ids=list(NOT_TEXT))
@pytest.mark.parametrize("command", list(CONFIG_COMMANDS))
def test_a_config_that_is_not_text_is_named(tmp_path, command, content):
    (tmp_path / "job.yaml").write_bytes(NOT_TEXT[content])
    line = refused(tmp_path, *CONFIG_COMMANDS[command], "--config", "job.yaml", names=["job.yaml", "UTF-8"])
    assert "Traceback" not in line


@pytest.mark.parametrize("command", ["simulate", "run"])
def test_a_config_that_is_a_folder_says_so(tmp_path, command):
    (tmp_path / "configs").mkdir()
    line = refused(tmp_path, *CONFIG_COMMANDS[command], "--config", "configs", names=["configs", "folder"])
    assert "does not exist" not in line


def test_a_toml_config_that_is_not_text_is_named(tmp_path):
    (tmp_path / "job.toml").write_bytes(NOT_TEXT["latin-1"])
    refused(tmp_path, "simulate", *SMALL, "--config", "job.toml", names=["job.toml", "UTF-8"])


# ----------------------------------------------------------------------------- numbers: non-finite, absurd


@pytest.mark.parametrize(
    "assignment,field",
    [
        ("hardware.memory_gib=.inf", "hardware.memory_gib"),
        ("hardware.peak_tflops=.inf", "hardware.peak_tflops"),
        ("hardware.mem_bw_gbs=.nan", "hardware.mem_bw_gbs"),
        ("hardware.linear_floor_us=.inf", "hardware.linear_floor_us"),
        ("hardware.step_overhead_ms=.inf", "hardware.step_overhead_ms"),
        ("drafters.0.acceptance.mean=.nan", "drafters.0.acceptance.mean"),
        ("rl.acceptance_drift_per_step=-.inf", "rl.acceptance_drift_per_step"),
        ("workload.response_len.median=.inf", "workload.response_len.median"),
        ("hardware.memory_gib=1e300", "hardware.memory_gib"),
        ("cluster.activation_reserve_gib=1e300", "cluster.activation_reserve_gib"),
    ],
)
def test_simulate_refuses_non_finite_and_absurd_numbers(tmp_path, assignment, field):
    refused(tmp_path, "simulate", "--json", "--out", "o", *SMALL, "--set", assignment, names=[field])


def test_both_peaks_infinite_are_refused_not_nan_in_summary(tmp_path):
    refused(
        tmp_path,
        "simulate",
        "--out",
        "o",
        *SMALL,
        "--set",
        "hardware.peak_tflops=.inf",
        "--set",
        "hardware.mem_bw_gbs=.inf",
        names=["hardware.peak_tflops", "finite"],
    )


def test_an_infinite_number_in_a_config_file_is_refused(tmp_path):
    data = load_preset_data("jobs", "default")
    data["hardware"] = load_preset_data("hardware", data["hardware"]) | {"memory_gib": float("inf")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    refused(tmp_path, "simulate", "--config", "job.yaml", *SMALL, names=["job.yaml", "hardware.memory_gib"])


def test_tiny_but_finite_hardware_gives_a_finite_valid_result(tmp_path):
    out = tmp_path / "o"
    proc = ok(
        rlsched(
            "simulate",
            "--json",
            "--out",
            str(out),
            *SMALL,
            "--set",
            "hardware.peak_tflops=1e-300",
            "--set",
            "hardware.step_overhead_ms=1e300",
            cwd=tmp_path,
        )
    )
    printed = strict_json(proc.stdout)
    written = strict_json((out / "summary.json").read_text())
    assert printed["generation_s"] == written["generation_s"] > 0
    strict_json((out / "meta.json").read_text())


@pytest.mark.parametrize(
    "assignment,field",
    [
        ("rollout.temperature=.nan", "rollout.temperature"),
        ("rollout.temperature=1e300", "rollout.temperature"),
        ("algorithm.lr=.inf", "algorithm.lr"),
        ("drafter_update.weight_max=.inf", "drafter_update.weight_max"),
        ("max_reward_failures=.nan", "max_reward_failures"),
    ],
)
def test_run_refuses_non_finite_config_numbers(tmp_path, assignment, field):
    refused(tmp_path, "run", "--out", "run", "--set", assignment, names=[field])


@pytest.mark.parametrize(
    "args,option",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "1e9"], "--temperature"),
        (["--top-p", "nan"], "--top-p"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
    ],
)
def test_generate_refuses_non_finite_sampling_options(tmp_path, args, option):
    refused(tmp_path, "generate", "--out", "gen", *args, names=[option])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_fit_refuses_a_non_finite_max_mape(tmp_path, value):
    refused(tmp_path, "fit", "nowhere", "--out", "cost.json", "--max-mape", value, names=["--max-mape"])


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_plot_refuses_a_non_finite_acceptance(tmp_path, value):
    (tmp_path / "folder").mkdir()
    refused(tmp_path, "plot", "folder", "--acceptance", value, names=["--acceptance"])


# ----------------------------------------------------------------------------- output places

# every command's output option, with what else it needs to get there (inputs need not
# exist: the output place is checked first)
OUT_COMMANDS = {
    "simulate": (["simulate", *SMALL], "--out", "folder"),
    "compare": (["compare", "--seeds", "1", "--workers", "1"], "--out", "folder"),
    "compare-plot": (["compare", "--seeds", "1", "--workers", "1"], "--plot", "fig.png"),
    "learn": (["learn"], "--out", "policy.json"),
    "learn-vllm-table": (["learn", "--out", "policy.json"], "--vllm-table", "table.json"),
    "plan": (["plan"], "--out", "folder"),
    "plot": (["plot", "nowhere"], "--out", "folder"),
    "report": (["report", "nowhere"], "--out", "page.html"),
    "fit": (["fit", "nowhere"], "--out", "cost.json"),
    "fit-plot": (["fit", "nowhere", "--out", "cost.json"], "--plot", "fit.png"),
    "replay": (["replay", "nowhere"], "--plot", "replay.png"),
    "import-vllm": (["import-vllm", "metrics.json"], "--out", "folder"),
    "run": (["run"], "--out", "folder"),
    "generate": (["generate"], "--out", "folder"),
    "profile": (["profile"], "--out", "folder"),
}


def _bad_places(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "a-file").write_text("not a folder\n")
    return {
        "unwritable": unwritable_folder(tmp_path) / "deeper",
        "parent-is-a-file": tmp_path / "a-file" / "deeper",
        "under-proc": Path("/proc/rlsched-out/deeper"),
    }


@pytest.mark.parametrize("place", ["unwritable", "parent-is-a-file", "under-proc"])
@pytest.mark.parametrize("command", list(OUT_COMMANDS))
def test_an_output_place_that_cannot_be_written_is_named(tmp_path, command, place):
    args, option, name = OUT_COMMANDS[command]
    target = _bad_places(tmp_path)[place] / name
    refused(tmp_path, *args, option, str(target), names=[option, str(target)])


@pytest.mark.parametrize("command", ["simulate", "run", "generate", "profile", "plan"])
def test_the_default_output_in_a_folder_that_cannot_be_written(tmp_path, command):
    cwd = Path("/proc") if os.geteuid() == 0 else unwritable_folder(tmp_path)
    args = [a for a in OUT_COMMANDS[command][0] if a not in SMALL] + (SMALL if command == "simulate" else [])
    line = one_line_error(rlsched(*args, cwd=cwd), "--out", "runs")
    assert "cannot write" in line


@pytest.mark.parametrize("command", ["simulate", "run", "generate", "profile"])
def test_an_output_folder_that_is_a_file_is_refused(tmp_path, command):
    (tmp_path / "taken").write_text("mine\n")
    refused(tmp_path, *OUT_COMMANDS[command][0], "--out", "taken", names=["--out", "taken", "file"])
    assert (tmp_path / "taken").read_text() == "mine\n"


@pytest.mark.parametrize("limit", [0, 3000])
def test_simulate_on_a_full_disk_leaves_nothing(tmp_path, limit):
    line = refused(
        tmp_path,
        "simulate",
        "--out",
        str(tmp_path / "a" / "b" / "c"),
        *SMALL,
        file_size_limit=limit,
        names=[str(tmp_path / "a" / "b" / "c"), "disk"],
    )
    assert "File too large" in line


def test_compare_on_a_full_disk_leaves_nothing(tmp_path):
    refused(
        tmp_path,
        "compare",
        *SMALL,
        "--policies",
        "off,static:2",
        "--seeds",
        "1",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "x" / "cmp"),
        file_size_limit=100,
        names=["cmp", "disk"],
    )


def test_a_failed_folder_removes_the_parents_it_created(tmp_path):
    from rlsched.atomic import atomic_folder

    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "kept" / "a" / "b" / "out") as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("the writer failed")
    assert snapshot(tmp_path) == {"kept"}


def test_a_failed_write_names_its_file(tmp_path):
    import errno

    from rlsched.atomic import atomic_path

    def failing_write():
        with atomic_path(tmp_path / "new" / "out.json"):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        failing_write()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "new" / "out.json")
    assert snapshot(tmp_path) == set()


def test_a_writable_place_passes_the_check_and_is_left_as_it_was(tmp_path):
    from rlsched.atomic import check_writable

    check_writable(tmp_path / "x" / "y", "--out")
    check_writable(tmp_path / "z.json", "--out", folder=False)
    assert snapshot(tmp_path) == set()


def test_json_outputs_refuse_nan():
    from rlsched.atomic import json_text

    assert strict_json(json_text({"a": [1.5, None]})) == {"a": [1.5, None]}
    with pytest.raises(ValueError):
        json_text({"generation_s": float("nan")})


# ----------------------------------------------------------------------------- messages


def test_a_policy_is_shown_as_typed_never_as_an_emoji(tmp_path):
    line = refused(tmp_path, "simulate", "--out", "o", *SMALL, "--policy", "twostate:a:b", names=["twostate:a:b"])
    assert "\U0001f170" not in line


def test_run_shows_the_policy_value_and_its_form(tmp_path):
    line = refused(tmp_path, "run", "--out", "run", "--policy", "static:", names=["static:", "static:4"])
    assert "valid string" not in line


def test_a_policy_yaml_reads_as_a_mapping_is_explained(tmp_path):
    refused(tmp_path, "run", "--out", "run", "--set", "policy=static:", names=["policy", "static", "quote"])


def test_user_text_is_not_read_as_markup(tmp_path):
    refused(tmp_path, "simulate", *SMALL, "--config", "[bold]job[/bold].yaml", names=["[bold]job[/bold].yaml"])
