"""`pdserve launch`'s pure parts: flag routing, token kept off command lines, restart back-off."""

from __future__ import annotations

import pytest

from common.launch.launcher import TOKEN_ENV, Backoff, child_env
from common.launch.role_args import split_extra_args, without


def test_flags_reach_the_roles_that_know_them() -> None:
    per_role = split_extra_args(["--api-key", "k1", "--auth-token=t", "--schedule-policy", "lpm"])
    assert per_role["bootstrap"] == ["--api-key", "k1", "--auth-token=t"]
    assert per_role["prefill"] == ["--auth-token=t", "--schedule-policy", "lpm"]
    assert per_role["decode"] == ["--auth-token=t"]


def test_the_token_goes_by_environment_never_argv() -> None:
    assert without(["--auth-token", "s", "--x", "1", "--auth-token=s2"], "--auth-token") == [
        "--x",
        "1",
    ]
    assert child_env("s3cret")[TOKEN_ENV] == "s3cret"


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run() -> None:
    b = Backoff(first_s=1, max_s=30, stable_s=60)
    assert [b.delay_after_exit(ran_s=2) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.delay_after_exit(ran_s=61) == 1  # it ran long enough: a fresh start
    assert b.delay_after_exit(ran_s=1) == 2


def test_help_lists_every_flag_launch_passes_on_with_its_roles() -> None:
    from common.launch.launcher import build_parser

    text = build_parser().format_help()
    for flag, roles in (
        ("--schedule-policy", "[prefill]"),
        ("--disaggregation-bootstrap-port", "[bootstrap]"),
        ("--lease-timeout", "[bootstrap,prefill,decode]"),
        ("--retraction-policy", "[decode]"),
        ("--api-key", "[bootstrap]"),
        ("--dtype", "[prefill,decode]"),
    ):
        line = next((x for x in text.splitlines() if x.strip().startswith(flag + " ")), "")
        assert roles in line, (flag, line)
    # Flags launch owns itself are not listed as passed on.
    passed_on = text.split("flags passed on", 1)[1]
    assert "  --model-path " not in passed_on and "  --port " not in passed_on
    assert "  --node-id " not in passed_on and "  --bootstrap-url " not in passed_on


def test_one_lease_reaches_every_role() -> None:
    per_role = split_extra_args(["--lease-timeout", "3"])
    assert all(per_role[role] == ["--lease-timeout", "3"] for role in per_role)


def test_launch_gives_each_node_its_own_id_and_registries() -> None:
    for flag in ("--node-id", "--bootstrap-url"):
        with pytest.raises(SystemExit, match="reserved"):
            split_extra_args([flag, "x"])


def test_a_colocated_process_gets_the_flags_both_roles_take_but_the_backend() -> None:
    from common.launch.role_args import colocated_args

    prefill = [
        "--disaggregation-transfer-backend",
        "fake",
        "--schedule-policy",
        "lpm",
        "--lease-timeout",
        "3",
    ]
    decode = [
        "--disaggregation-transfer-backend",
        "fake",
        "--retraction-policy",
        "length",
        "--lease-timeout",
        "3",
        "--prefill-endpoint",
        "p=tcp://h:1",
    ]
    assert colocated_args(prefill, decode) == [
        "--schedule-policy",
        "lpm",
        "--lease-timeout",
        "3",
        "--retraction-policy",
        "length",
    ]


# --- --gpus: one GPU per node -----------------------------------------------------------------

NODES = ["prefill-0", "prefill-1", "decode-0"]


def test_each_node_gets_its_own_gpu_in_order_and_runs_on_cuda() -> None:
    from common.launch.launcher import place_on_gpus

    placed = place_on_gpus("0,1,2,3", NODES, device=None)
    assert list(placed) == NODES  # prefill first, then decode; GPU 3 is left unused
    assert [p.env for p in placed.values()] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
        {"CUDA_VISIBLE_DEVICES": "2"},
    ]
    assert all(p.args == ("--device", "cuda") for p in placed.values())
    assert place_on_gpus(" 4, 6 ,GPU-8f2c", NODES, None)["decode-0"].env == {
        "CUDA_VISIBLE_DEVICES": "GPU-8f2c"  # UUIDs work as CUDA_VISIBLE_DEVICES takes them
    }


def test_a_users_cuda_device_is_kept_and_not_repeated() -> None:
    from common.launch.launcher import place_on_gpus

    for device in ("cuda", "cuda:0"):
        placed = place_on_gpus("2,3,5", NODES, device=device)
        assert [p.args for p in placed.values()] == [(), (), ()]
        assert placed["prefill-1"].env == {"CUDA_VISIBLE_DEVICES": "3"}


@pytest.mark.parametrize(
    ("gpus", "device", "message"),
    [
        ("0,1", None, "2 GPUs for 3 nodes"),
        ("0", None, "1 GPU for 3 nodes"),
        ("0,1,1", None, "GPU 1 twice"),
        ("0,,1", None, "empty"),
        ("", None, "empty"),
        ("0,1,2", "cpu", "--device cpu"),
        ("0,1,2", "cuda:1", "cuda:0"),  # each node sees only its own GPU, as cuda:0
    ],
)
def test_gpus_are_refused_with_a_reason(gpus: str, device: str | None, message: str) -> None:
    from common.launch.launcher import LaunchError, place_on_gpus

    with pytest.raises(LaunchError, match=message):
        place_on_gpus(gpus, NODES, device)


class _Proc:
    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


class _Started:
    """Stands in for Child: records what launch would start, starts nothing."""

    started: list[_Started] = []

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.argv, self.env, self.proc = name, argv, env, _Proc()
        _Started.started.append(self)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[_Started]:
    import common.launch.launcher as launcher

    _Started.started = []
    monkeypatch.setattr(launcher, "Child", _Started)
    monkeypatch.setattr(launcher, "_wait_healthy", lambda *args: False)
    monkeypatch.setattr(launcher.signal, "signal", lambda *args: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return _Started.started


def _device_of(argv: list[str]) -> str | None:
    return argv[argv.index("--device") + 1] if "--device" in argv else None


def test_launch_gives_each_child_its_gpu_and_the_bootstrap_none(started: list[_Started]) -> None:
    from common.launch.launcher import main

    assert main(["--gpus", "3,1,0", "--num-prefill", "1", "--num-decode", "2"]) == 1
    seen = {c.name: (c.env.get("CUDA_VISIBLE_DEVICES"), _device_of(c.argv)) for c in started}
    assert seen == {
        "bootstrap": ("", None),
        "prefill-0": ("3", "cuda"),
        "decode-0": ("1", "cuda"),
        "decode-1": ("0", "cuda"),
    }


def test_launch_colocated_gives_each_process_one_gpu(started: list[_Started]) -> None:
    from common.launch.launcher import main

    assert main(["--colocated", "--num-prefill", "2", "--gpus", "0,1", "--device", "cuda"]) == 1
    seen = {c.name: (c.env.get("CUDA_VISIBLE_DEVICES"), c.argv.count("--device")) for c in started}
    assert seen == {"bootstrap": ("", 0), "colocated-0": ("0", 1), "colocated-1": ("1", 1)}


def test_launch_without_gpus_is_unchanged(started: list[_Started]) -> None:
    from common.launch.launcher import main

    assert main(["--num-decode", "1"]) == 1
    assert all("CUDA_VISIBLE_DEVICES" not in c.env and "--device" not in c.argv for c in started)


@pytest.mark.parametrize("argv", [["--gpus", "0"], ["--gpus", "0,1", "--device", "cpu"]])
def test_launch_refuses_bad_gpus_before_starting_anything(
    started: list[_Started], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from common.launch.launcher import main

    assert main(argv) == 2
    assert started == []
    assert "pdserve launch: error: --gpus" in capsys.readouterr().err
