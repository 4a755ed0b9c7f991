"""Every bad input is refused up front with a message that names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral import InvalidSpec, Limits, Sandbox, SandboxSpec
from corral.spec import parse_env_assignments, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("512M", 512 << 20), ("1GiB", 1 << 30), ("1.5g", 3 << 29), ("1048576", 1 << 20), ("64k", 64 << 10),
    ("2GB", 2 << 30), (4096, 4096),
])
def test_sizes_parse(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "", "-1M", "M", "1.2.3G", "0", "abc", "1 Q"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(InvalidSpec, match=r"size|positive|parse"):
        parse_size(text)


def test_defaults_are_safe() -> None:
    limits = Limits()
    assert (limits.memory, limits.pids, limits.cpus, limits.disk, limits.timeout) == (512 << 20, 256, 1.0, 1 << 30, 60.0)
    assert SandboxSpec().network == "none"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pids": "-5"}, "pids"), ({"pids": "many"}, "pids"), ({"memory": "1K"}, "memory"), ({"cpus": "0"}, "cpus"),
    ({"cpus": "nan"}, "cpus"), ({"timeout": "-1"}, "timeout"), ({"disk": "10XB"}, "disk"),
])
def test_bad_limits_are_refused(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        Limits.build(**kwargs)  # type: ignore[arg-type]


def test_bad_spec_fields_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="tier"):
        SandboxSpec(tier="docker")
    with pytest.raises(InvalidSpec, match="network"):
        SandboxSpec(network="everything")
    with pytest.raises(InvalidSpec, match="image"):
        SandboxSpec(image="../etc")
    with pytest.raises(InvalidSpec, match="does not exist"):
        Sandbox.create(workspace=str(tmp_path / "missing"))
    with pytest.raises(InvalidSpec, match="not a valid variable"):
        SandboxSpec(env={"1BAD": "x"})
    with pytest.raises(InvalidSpec, match="NAME=VALUE"):
        parse_env_assignments(["HOME"])
    with pytest.raises(InvalidSpec, match="unknown field"):
        SandboxSpec.from_dict({"image": "host", "privileged": True})
    with pytest.raises(InvalidSpec, match=r"not (known|built)"):
        Sandbox.create(image="no-such-image")


def test_from_dict_round_trip(tmp_path: Path) -> None:
    spec = SandboxSpec.from_dict({"limits": {"memory": "256M", "pids": 32}, "workspace": f"{tmp_path}:ro",
                                  "env": {"A": "1"}})
    assert spec.limits.memory == 256 << 20 and spec.limits.pids == 32
    assert spec.workspace is not None and spec.workspace.mode == "ro"
    assert SandboxSpec.from_dict(spec.to_dict()) == spec


def test_json_nulls_are_absent_or_refused_never_a_crash() -> None:
    # found by the OpenAPI fuzzer: {"env": null} crashed validation (a 500 from the server)
    assert SandboxSpec.from_dict({"env": None}).env == {}
    spec = SandboxSpec.from_dict({"env": None, "network": "allow", "secrets": ["TOKEN@api.example.com"]})
    assert spec.env == {} and [s.name for s in spec.secrets] == ["TOKEN"]
    for field in ("allow", "unsafe_allow_ranges", "secrets"):
        with pytest.raises(InvalidSpec, match=f"{field}: expected a list"):
            SandboxSpec.from_dict({field: None})
    with pytest.raises(InvalidSpec, match="must be a string"):
        SandboxSpec.from_dict({"env": {"A": None}})


@pytest.mark.parametrize("make", [
    lambda: SandboxSpec.from_dict({"image": "python\n"}),
    lambda: SandboxSpec.from_dict({"network": "allow", "allow": ["example.com"], "secrets": ["TOKEN\n@example.com"]}),
    lambda: __import__("corral.images.recipe", fromlist=["parse"]).parse({"name": "img\n"}),
    lambda: __import__("corral.images.recipe", fromlist=["parse"]).parse({"name": "img", "apt": ["curl\n"]}),
], ids=["image", "secret name", "recipe name", "apt package"])
def test_a_name_ending_in_a_newline_is_refused(make: object) -> None:
    # "^...$" also matches before a final newline: each of these was taken with it (hosts in
    # allow rules and secret bindings are stripped of surrounding whitespace instead)
    with pytest.raises(InvalidSpec):
        make()  # type: ignore[operator]


def test_an_error_quotes_at_most_a_few_hundred_characters_of_a_bad_value() -> None:
    # a request may carry megabytes where a name belongs; the message went back with all of it
    with pytest.raises(InvalidSpec) as caught:
        SandboxSpec.from_dict({"network": "x" * 1_000_000})
    assert len(str(caught.value)) < 400 and "1000002 characters" in str(caught.value)
