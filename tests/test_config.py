"""Configuration loading: precedence, and errors that name the field and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from qosd.config import Config, ConfigError, FailMode, load_config
from qosd.policy import SHARED_PASS_STRETCH, ClassPolicy, resolve_pools

pytestmark = pytest.mark.fast


def resolve_policies(config: Config) -> dict[tuple[str, str], ClassPolicy]:
    return {(p.name, c.name): c for p in resolve_pools(config).values() for c in p.classes}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "qosd.yaml"
    path.write_text(text)
    return path


def test_defaults_follow_the_brief() -> None:
    config = load_config(env={})
    assert config.redis.url is None  # embedded store
    assert config.fail_mode is FailMode.CLOSED
    assert config.server.listen == ["127.0.0.1:50051"]
    policies = resolve_policies(config)
    shares = {name: policies[("default", name)].rate / 100_000 for name in ("P0", "P1", "P2")}
    assert shares == pytest.approx({"P0": 0.60, "P1": 0.35, "P2": 0.05})
    p1 = policies[("default", "P1")]
    assert p1.burst == pytest.approx(0.5 * p1.rate)
    assert p1.max_cost == p1.burst
    assert all(p.max_wait_ms > 0 for p in policies.values())


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "fail_mode: open\nredis: {url: 'redis://file:1/0', timeout_ms: 7}\n")
    from_file = load_config(path, env={})
    assert (from_file.fail_mode, from_file.redis.url) == (FailMode.OPEN, "redis://file:1/0")
    env = {"QOSD_REDIS_URL": "redis://env:2/0", "QOSD_LISTEN": "127.0.0.1:1, unix:/tmp/q.sock"}
    from_env = load_config(path, env=env)
    assert from_env.redis.url == "redis://env:2/0"
    assert from_env.redis.timeout_ms == 7  # untouched keys keep the file's value
    assert from_env.server.listen == ["127.0.0.1:1", "unix:/tmp/q.sock"]
    from_flags = load_config(path, env=env, overrides={("redis", "url"): "redis://flag:3/0"})
    assert from_flags.redis.url == "redis://flag:3/0"


def test_explicit_burst_and_max_cost(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pools: {default: {capacity_tokens_s: 1000}}\n"
        "classes:\n"
        "  hi: {priority: 0, share: 0.5, burst_tokens: 300, max_cost_tokens: 900, weight: 2}\n"
        "  lo: {priority: 1, share: 0.5}\n",
    )
    policy = resolve_policies(load_config(path, env={}))[("default", "hi")]
    assert (policy.rate, policy.burst, policy.max_cost, policy.weight) == (500, 300, 900, 2)


BAD_CONFIGS = [
    ("classes:\n  P0: {priority: 0, share: 1.5}\n", "classes.P0.share"),
    ("classes:\n  P0: {priority: 0, share: 0.5, colour: red}\n", "classes.P0.colour"),
    ("bogus: 1\n", "bogus: Extra inputs are not permitted"),
    ("server: {listen: ['nowhere']}\n", "expected HOST:PORT or unix:PATH"),
    ("server: {listen: []}\n", "needs at least one address"),
    ("redis: {url: 'http://x'}\n", "redis.url: must start with redis://"),
    ("fail_mode: sideways\n", "fail_mode"),
    (
        "classes:\n  A: {priority: 0, share: 0.5}\n  B: {priority: 0, share: 0.5}\n",
        "distinct priority",
    ),
    (
        "classes:\n  A: {priority: 0, share: 0.7}\n  B: {priority: 1, share: 0.7}\n",
        "shares add up to 1.400",
    ),
    (
        "pools:\n  a: {capacity_tokens_s: 1, models: [m]}\n"
        "  b: {capacity_tokens_s: 1, models: [m]}\ndefault_pool: a\n",
        "model 'm' is already served by pool 'a'",
    ),
    ("default_pool: elsewhere\n", "default_pool: no pool named 'elsewhere'"),
    ("pools: {'bad{name}': {capacity_tokens_s: 1}}\ndefault_pool: null\n", "name must match"),
    (
        "classes:\n  P0: {priority: 0, share: 0.5, max_cost_tokens: 10}\n",
        "max_cost_tokens: 10 is below the burst",
    ),
    ("classes: [1, 2]\n", "classes"),
    ("waiting: {poll_ms: 100, stale_after_ms: 200}\n", "must be at least 4 times"),
    ("- just\n- a list\n", "top level must be a mapping"),
    ("classes: {P0: {priority: 0, share: 0.5\n", "not valid YAML"),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_bad_config_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid configuration|config file") as info:
        load_config(write(tmp_path, text), env={})
    assert message in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml", env={})


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"\$QOSD_REDIS_TIMEOUT_MS") as info:
        load_config(env={"QOSD_REDIS_TIMEOUT_MS": "soon"})
    assert "redis.timeout_ms" in str(info.value)


def test_the_example_config_spells_out_the_defaults() -> None:
    """qosd/examples/qosd.yaml documents every setting at its default; keep it true."""
    example = Path(__file__).resolve().parents[1] / "qosd" / "examples" / "qosd.yaml"
    assert load_config(str(example), env={}).model_dump() == Config().model_dump()


def _backlog_ms(pool: dict[str, object], top_max_wait_ms: int | None = None) -> float:
    tree = Config().model_dump(mode="json")
    tree["pools"] = {"default": {"capacity_tokens_s": 1000, "max_in_flight": 8, **pool}}
    if top_max_wait_ms is not None:
        tree["classes"]["P0"]["max_wait_ms"] = top_max_wait_ms
    return resolve_pools(Config.model_validate(tree))["default"].prefill_backlog_us / 1000


def test_prompts_share_passes_only_on_chunked_servers_that_serve_the_top_class_first() -> None:
    """The cap on one prompt's tokens per pass comes with priority scheduling on a
    chunked server (PoolConfig.servers_schedule_by_priority); elsewhere prompts are
    prefilled one after another, and a top-class prompt waits for the whole backlog."""

    def stretch(pool: dict[str, object]) -> float:
        tree = {"pools": {"default": {"capacity_tokens_s": 10_000, **pool}}}
        return resolve_pools(Config.model_validate(tree))["default"].shared_pass_stretch

    both: dict[str, object] = {"servers_schedule_by_priority": True, "chunked_prefill": True}
    assert stretch(both) == SHARED_PASS_STRETCH > 0
    assert stretch({**both, "chunked_prefill": False}) == 0
    assert stretch({**both, "servers_schedule_by_priority": False}) == 0


def test_the_prefill_backlog_bound_defaults_to_the_top_objective_less_its_max_wait() -> None:
    # Built-in classes: P0's TTFT objective 500 ms, its max wait 200 ms.
    assert _backlog_ms({}) == 300
    # Never below half the objective, however long the top class may wait.
    assert _backlog_ms({}, top_max_wait_ms=900) == 250
    # Set: as set. Chunked prefill too: a chunked server's backlog of prompts fills
    # every pass, and every stream's time per output token grows with it.
    assert _backlog_ms({"max_prefill_backlog_ms": 700}) == 700
    assert _backlog_ms({"chunked_prefill": True}) == 300


def test_a_file_that_is_not_yaml_is_named_without_its_text(tmp_path: Path) -> None:
    """PyYAML's message quotes the bad line, which may hold a password: the error says
    what and where, never the text (it is logged at every refused reload)."""
    path = write(tmp_path, 'redis:\n  url: "redis://:s3cret@redis:6379/0\n  mode: cluster\n')
    with pytest.raises(
        ConfigError, match=r"is not valid YAML: .* at line \d+, column \d+"
    ) as raised:
        load_config(path, env={})
    assert "s3cret" not in str(raised.value)
