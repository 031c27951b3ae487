"""The policy registry: one grammar for every engine, each refusal one line in the command's
words, and the help texts built from it."""

import pytest
from support import rlsched

from rlsched.errors import UserError
from rlsched.policies.draft import GoodputPolicy, OffPolicy, PolicyContext, StaticPolicy
from rlsched.policies.registry import FAMILIES, GENERATE, SIMULATOR, make_draft_policy, parse_policy, run_words, usage

EXAMPLES = {
    "off": "off",
    "static": "static:3",
    "goodput": "goodput:drain",
    "seqgoodput": "seqgoodput:4",
    "twostate": "twostate:16:2",
    "bandit": "bandit:0.2",
    "table": "table:p.json",
    "oracle": "oracle:seq",
    "tree": "tree:6:4:24",
    "plugin": "plugin:plugin_policies.cycling",
}


def test_every_family_has_an_example_and_parses_to_itself():
    assert set(EXAMPLES) == set(FAMILIES)
    for family, text in EXAMPLES.items():
        assert parse_policy(text).family == family
        assert FAMILIES[family].usage.partition(":")[0].partition("[")[0] == family


def test_a_plugin_is_the_users_own_policy_by_qualified_name():
    ctx = PolicyContext(None, ("model",), k_max=6)
    policy = make_draft_policy("plugin:plugin_policies.cycling", ctx)
    assert type(policy).__name__ == "Cycling" and policy.drafter == "model"
    for text, message in (
        ("plugin:no_such_module.make", "cannot import no_such_module.make"),
        ("plugin:plugin_policies.NOT_A_POLICY", "must return a DraftPolicy"),
    ):
        with pytest.raises(UserError, match=message):
            make_draft_policy(text, ctx)
    with pytest.raises(UserError, match="unknown policy"):
        parse_policy("plugin:not a name")


def test_arguments_are_parsed_once():
    s = parse_policy(" static:4:ngram ")
    assert (s.text, s.k, s.drafter, s.drafts) == ("static:4:ngram", 4, "ngram", True)
    assert not parse_policy("static:0").drafts and not parse_policy("off").drafts
    assert parse_policy("goodput:8").refresh == 8 and parse_policy("goodput:drain").drain
    assert (parse_policy("twostate:32:4").max_batch, parse_policy("twostate:32:4").k) == (32, 4)
    assert parse_policy("bandit:0.3").epsilon == 0.3
    bare = parse_policy("learned.json")
    assert bare.family is None and bare.file == "learned.json"
    # what needs a cost model: the priced families, and twostate only when it solves
    assert [
        parse_policy(t).priced
        for t in (
            "goodput",
            "seqgoodput",
            "oracle",
            "twostate",
            "twostate:8:2",
            "twostate:p.json",
            "static:3",
            "bandit",
            "table:p.json",
        )
    ] == [True, True, True, True, False, False, False, False, False]


@pytest.mark.parametrize(
    "text, message",
    [
        ("static:x", "K must be a whole number >= 0, as in static:4"),
        ("goodput:0", "refresh interval must be a whole number >= 1 or 'drain'"),
        ("seqgoodput:drain", "refresh interval must be a whole number >= 1, as in seqgoodput:1"),
        ("twostate:8", "expected twostate:MAX_BATCH:K"),
        ("bandit:2", "epsilon must be a number in [0, 1]"),
        ("table", "needs a policy file"),
        ("fastest", "unknown policy 'fastest'; choose from off, static:K[:DRAFTER]"),
    ],
)
def test_malformed_specs_are_one_line(text, message):
    with pytest.raises(UserError) as e:
        parse_policy(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_each_command_refuses_in_its_own_words():
    with pytest.raises(UserError, match=r"K = 9 is above --k-max = 6; lower K or raise --k-max"):
        parse_policy("static:9").check(("model",), 6, GENERATE)
    with pytest.raises(UserError, match=r"K = 9 is above speculation.k_max = 8"):
        parse_policy("static:9").check(("model",), 8, SIMULATOR)
    with pytest.raises(UserError, match=r"K = 5 is above rollout.k_max = 4"):
        parse_policy("twostate:8:5").check(("model",), 4, run_words("local"))
    with pytest.raises(UserError, match=r"drafts, but --drafter is off"):
        parse_policy("static:3").check((), 6, GENERATE)
    with pytest.raises(UserError, match=r"drafts, but the config has no drafters"):
        parse_policy("goodput").check((), 6, SIMULATOR)
    with pytest.raises(UserError, match=r"unknown drafter 'eagle'; --drafter gives model"):
        parse_policy("static:2:eagle").check(("model",), 6, GENERATE)
    with pytest.raises(UserError, match=r"true acceptance; it runs in `rlsched simulate`"):
        parse_policy("oracle").check(("model",), 6, GENERATE)
    with pytest.raises(UserError, match=r"true acceptance; it runs in `rlsched simulate`"):
        parse_policy("oracle").check(("model",), 6, run_words("vllm"))
    parse_policy("goodput").check(("model",), 6, run_words("vllm"))  # rlsched's policies run inside vLLM
    parse_policy("static:0").check((), 6, GENERATE)  # plain decoding needs no drafter
    parse_policy("oracle").check(("model",), 6, SIMULATOR)


def test_usage_lists_what_each_engine_runs():
    assert "oracle" in usage("simulator") and "oracle" not in usage("local")
    assert "tree:K:W:N" in usage("simulator") and "tree:K:W:N" in usage("local")
    assert "tree:" not in usage("vllm")  # vLLM drafts chains
    vllm = usage("vllm")
    assert all(name in vllm for name in ("off", "static:K", "twostate", "table:FILE", "goodput", "bandit"))
    assert "oracle" not in vllm


def test_the_builder_follows_the_spec():
    ctx = PolicyContext(cost=None, drafters=("model", "ngram"), k_max=6)
    assert isinstance(make_draft_policy("static:0", ctx), OffPolicy)
    static = make_draft_policy("static:4:ngram", ctx)
    assert isinstance(static, StaticPolicy) and static.strategy.drafter == "ngram" and static.strategy.k == 4
    assert make_draft_policy("goodput:drain", ctx)._tokens.__name__ == "drain_tokens"
    assert isinstance(make_draft_policy(parse_policy("goodput:5"), ctx), GoodputPolicy)


def test_help_texts_come_from_the_registry(tmp_path):
    for command, engine in (("simulate", "simulator"), ("generate", "local")):
        out = rlsched(command, "--help", cwd=tmp_path).stdout.replace("\n", " ")
        assert "seqgoodput[:REFRESH]" in " ".join(out.split())
        assert ("oracle[:seq]" in " ".join(out.split())) == (engine == "simulator")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "static:9", "--k-max", "6"], "policy 'static:9': K = 9 is above --k-max = 6"),
        (["--drafter", "off", "--policy", "static:3"], "policy 'static:3' drafts, but --drafter is off"),
        (["--policy", "oracle"], "policy 'oracle' reads the simulator's true acceptance"),
    ],
)
def test_generate_refuses_what_it_cannot_run(tmp_path, args, message):
    pytest.importorskip("torch")
    proc = rlsched("generate", *args, "--n", "1", "--max-tokens", "8", "--out", str(tmp_path / "g"), cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "g").exists()


def test_an_unknown_name_lists_what_the_engine_runs():
    with pytest.raises(UserError, match=r"unknown policy 'nosuch'; choose from off,.*oracle") as sim:
        parse_policy("nosuch")
    with pytest.raises(UserError, match=r"unknown policy 'nosuch'; choose from off,.*goodput") as run:
        parse_policy("nosuch", "vllm")
    assert "oracle" in str(sim.value) and "oracle" not in str(run.value)


def test_a_new_family_is_one_entry_of_the_table(monkeypatch):
    from rlsched.policies.registry import Family, PolicySpec

    entry = Family(
        "fixed",
        "fixed:K",
        "K drafts every step, in the simulator only",
        lambda text, arg: PolicySpec(text, "fixed", k=int(arg)),
        lambda p, ctx, words: StaticPolicy(ctx.drafters[0], p.k),
        engines=("simulator",),
    )
    monkeypatch.setitem(FAMILIES, "fixed", entry)
    assert parse_policy("fixed:2").k == 2 and "fixed:K" in usage("simulator") and "fixed:K" not in usage("local")
    ctx = PolicyContext(cost=None, drafters=("model",), k_max=6)
    assert make_draft_policy(parse_policy("fixed:2"), ctx).strategy.k == 2
    with pytest.raises(UserError, match="true acceptance"):
        parse_policy("fixed:2").check(("model",), 6, GENERATE)
