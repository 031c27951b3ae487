"""The drafting-policy names: one grammar, parsed once, checked once per command.

A policy spec is `NAME[:ARG[:ARG]]` (`off`, `static:4:ngram`, `goodput:drain`, `table:p.json`)
or a bare policy file `PATH.json` (the policy it holds). `parse_policy` turns the text into a
`PolicySpec` once, where it enters (a CLI option, a config field); the spec travels down from
there. `FAMILIES` is the one table of the families: each one's grammar and words for `--help`,
its parser, its builder, the engines that run it and whether a guard holds it to plain decoding
(`policies/guard.py`: the adaptive families and policy files; `:unguarded` after the name, as in
`goodput:drain:unguarded` or `p.json:unguarded`, runs one bare). `PolicySpec.check` holds a spec
against one command's limits (its drafters, its longest draft, its engine) and words every
refusal in that command's terms (`Words`); `make_draft_policy` builds the policy from the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rlsched.errors import UserError

ENGINES = ("simulator", "local", "vllm")


@dataclass(frozen=True)
class Words:
    """How a command names the limits a policy is checked against, for its messages."""

    engine: str  # one of ENGINES
    k_max: str  # the option or field that caps the draft length
    drafters: str  # introduces the drafter names the command has
    no_drafter: str  # what to do when the command has no drafter


SIMULATOR = Words(
    "simulator",
    "speculation.k_max",
    "the config has",
    "the config has no drafters; add one (drafters: [...]) or use policy off",
)
GENERATE = Words(
    "local",
    "--k-max",
    "--drafter gives",
    "--drafter is off; give --drafter builtin, a model folder or ngram, or --policy off",
)


def run_words(engine: str) -> Words:
    """`rlsched run`'s words (its config fields), for the local or the vLLM engine."""
    return Words(
        engine,
        "rollout.k_max",
        "the config has",
        "drafter is off; set drafter (a model folder, builtin or ngram) or policy off",
    )


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy name. `k` is static's, tree's and twostate's draft length; `drafter`
    static's and tree's (None: the first the command has); `max_batch` twostate's threshold;
    `file` a table or twostate policy file (`family` None for a bare PATH.json: the kind the
    file holds). `text` is the name as given: messages and written files say it."""

    text: str
    family: str | None
    k: int = 0
    drafter: str | None = None
    refresh: int = 32
    drain: bool = False
    max_batch: int | None = None
    epsilon: float = 0.1
    file: str | None = None
    per_row: bool = False  # oracle:seq
    width: int = 1  # tree's
    nodes: int = 0  # tree's
    target: str | None = None  # plugin's: the qualified name of a callable (PolicyContext) -> DraftPolicy
    guarded: bool = False  # held to plain decoding (`policies/guard.py`); off with the UNGUARDED suffix

    def __str__(self) -> str:
        return self.text

    @property
    def drafts(self) -> bool:
        """Whether the policy ever drafts (off and static:0 never do)."""
        return not (self.family == "off" or (self.family == "static" and self.k == 0))

    @property
    def priced(self) -> bool:
        """Whether the policy needs a cost model (twostate only when it solves over one)."""
        if self.family == "twostate":
            return self.file is None and self.max_batch is None
        return self.family is not None and FAMILIES[self.family].priced

    def check(self, drafters: tuple[str, ...], k_max: int, words: Words = SIMULATOR) -> PolicySpec:
        """This spec against a command's drafters, longest draft and engine; UserError, one
        line in the command's words, for what it cannot run. Returns self."""
        fam = FAMILIES.get(self.family) if self.family else None
        if fam is not None and words.engine not in fam.engines:
            if fam.engines == ("simulator",):
                raise UserError(
                    f"policy '{self.text}' reads the simulator's true acceptance; it runs in "
                    "`rlsched simulate`, `compare` and `learn` only"
                )
            raise UserError(
                f"policy '{self.text}' drafts a tree; the {words.engine} engine drafts chains: use static:K"
            )
        if self.drafts and not drafters:
            raise UserError(f"policy '{self.text}' drafts, but {words.no_drafter}")
        if self.drafter is not None and self.drafter not in drafters:
            raise UserError(
                f"policy '{self.text}': unknown drafter '{self.drafter}'; {words.drafters} {', '.join(drafters)}"
            )
        if self.family in ("static", "twostate", "tree") and self.k > k_max:
            raise UserError(
                f"policy '{self.text}': K = {self.k} is above {words.k_max} = {k_max}; lower K or raise {words.k_max}"
            )
        if self.family == "tree" and words.engine != "simulator" and self.nodes > k_max:
            raise UserError(
                f"policy '{self.text}': N = {self.nodes} drafts a row is above {words.k_max} = {k_max} "
                f"(the cache's room a step); lower N or raise {words.k_max}"
            )
        return self


# --- each family's grammar: (the whole text, what follows NAME:) -> its spec, or None -----------


MAX_DIGITS = 18  # a number in a policy name fits 64 bits


def _digits(text: str) -> int | None:
    """The whole number an ASCII digit string of at most MAX_DIGITS spells; None for anything
    else (a sign, a space, a digit of another script such as '²')."""
    if not (text.isascii() and text.isdigit()) or len(text) > MAX_DIGITS:
        return None
    return int(text)


def _whole(text: str, spec: str, what: str, example: str, least: int = 0) -> int:
    n = _digits(text)
    if n is None or n < least:
        raise UserError(f"policy '{spec}': {what} must be a whole number >= {least}, as in {example}{_long(text)}")
    return n


def _long(text: str) -> str:
    """A note for a number past MAX_DIGITS, for the messages that refuse it."""
    return f" (at most {MAX_DIGITS} digits)" if len(text) > MAX_DIGITS else ""


def _full_tree(k: int, w: int, n: int) -> int:
    """The drafts of a full tree k deep and w wide (w + w^2 + ... + w^k), counted up to the
    first level past n (a deep tree's count would take time and memory for nothing)."""
    total, level = 0, 1
    for _ in range(k):
        level *= w
        total += level
        if total > n:
            break
    return total


def _parse_off(spec: str, arg: str) -> PolicySpec | None:
    return None if arg else PolicySpec(spec, "off")


def _parse_static(spec: str, arg: str) -> PolicySpec:
    k_text, _, drafter = arg.partition(":")
    return PolicySpec(spec, "static", k=_whole(k_text, spec, "K", "static:4"), drafter=drafter or None)


def _parse_tree(spec: str, arg: str) -> PolicySpec:
    parts = arg.split(":")
    example = "tree:6:4:24"
    if len(parts) not in (3, 4):
        raise UserError(
            f"policy '{spec}': expected tree:K:W:N[:DRAFTER] (depth, width, drafts verified), as in {example}"
        )
    k = _whole(parts[0], spec, "K (the depth)", example, 1)
    w = _whole(parts[1], spec, "W (candidates a branch)", example, 2)
    n = _whole(parts[2], spec, "N (drafts verified)", example, k)
    most = _full_tree(k, w, n)
    if n > most:
        raise UserError(f"policy '{spec}': a tree {k} deep and {w} wide holds at most {most} drafts; lower N")
    return PolicySpec(spec, "tree", k=k, width=w, nodes=n, drafter=parts[3] if len(parts) == 4 else None)


def _parse_refresh(name: str) -> Callable[[str, str], PolicySpec]:
    """goodput's and seqgoodput's: a refresh interval (goodput also takes drain)."""

    def parse(spec: str, arg: str) -> PolicySpec:
        if name == "goodput" and arg == "drain":
            return PolicySpec(spec, name, drain=True)
        refresh = _digits(arg) if arg else 32
        if refresh is None or refresh < 1:
            also = " or 'drain' (goodput:drain)" if name == "goodput" else ""
            raise UserError(
                f"policy '{spec}': the refresh interval must be a whole number >= 1{also}, as in {name}:1{_long(arg)}"
            )
        return PolicySpec(spec, name, refresh=refresh)

    return parse


def _parse_twostate(spec: str, arg: str) -> PolicySpec:
    if not arg:
        return PolicySpec(spec, "twostate")
    if arg.endswith(".json"):
        return PolicySpec(spec, "twostate", file=arg)
    t, _, k = arg.partition(":")
    max_batch, k_n = _digits(t), _digits(k)
    if max_batch is None or k_n is None or k_n < 1:
        raise UserError(
            f"policy '{spec}': expected twostate:MAX_BATCH:K with whole numbers (K >= 1), as in twostate:32:4"
            f"{_long(max(t, k, key=len))}"
        )
    return PolicySpec(spec, "twostate", k=k_n, max_batch=max_batch)


def _parse_bandit(spec: str, arg: str) -> PolicySpec:
    try:
        eps = float(arg) if arg else 0.1
    except ValueError:
        eps = -1.0
    if not 0.0 <= eps <= 1.0:
        raise UserError(f"policy '{spec}': epsilon must be a number in [0, 1], as in bandit:0.1")
    return PolicySpec(spec, "bandit", epsilon=eps)


def _parse_table(spec: str, arg: str) -> PolicySpec:
    if not arg:
        raise UserError("policy 'table' needs a policy file: table:PATH.json (write one with `rlsched learn`)")
    return PolicySpec(spec, "table", file=arg)


def _parse_oracle(spec: str, arg: str) -> PolicySpec | None:
    return PolicySpec(spec, "oracle", per_row=arg == "seq") if arg in ("", "seq") else None


# --- each family's builder: (spec, PolicyContext, Words) -> DraftPolicy ---------------------------
# (the policies are imported in the builders: the grammar needs neither numpy nor the policies,
# and the CLI's help reads it)


def _build_static(p: PolicySpec, ctx, words: Words):
    from rlsched.policies.draft import StaticPolicy

    return StaticPolicy(p.drafter or ctx.drafters[0], p.k, p.width, p.nodes)


def _build_goodput(p: PolicySpec, ctx, words: Words):
    from rlsched.policies.draft import GoodputPolicy

    return GoodputPolicy(ctx, refresh=p.refresh, drain=p.drain)


def _build_seqgoodput(p: PolicySpec, ctx, words: Words):
    from rlsched.policies.draft import SeqGoodputPolicy

    return SeqGoodputPolicy(ctx, refresh=p.refresh)


def _build_twostate(p: PolicySpec, ctx, words: Words):
    from rlsched.policies.lookup import TwoStatePolicy

    if p.file is not None:
        return _build_file(p, ctx, words)
    if p.max_batch is None:
        return TwoStatePolicy.solve(ctx)
    return TwoStatePolicy(ctx, ctx.drafters[0], p.max_batch, p.k)


def _build_bandit(p: PolicySpec, ctx, words: Words):
    from rlsched.policies.bandit import BanditPolicy

    return BanditPolicy(ctx, epsilon=p.epsilon)


def _build_file(p: PolicySpec, ctx, words: Words):
    """A table or twostate policy file (`table:FILE`, `twostate:FILE`, a bare PATH.json)."""
    from rlsched.policies.lookup import TablePolicy, TwoStatePolicy
    from rlsched.policies.policyfile import load_policy_file  # (pydantic: only for policy files)

    pf = load_policy_file(p.file, ctx.identity, kinds=(p.family,) if p.family else ("table", "twostate"))
    return (TablePolicy if pf.kind == "table" else TwoStatePolicy).from_file(pf, ctx, words.k_max)


def _parse_plugin(spec: str, arg: str) -> PolicySpec | None:
    parts = arg.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        return None
    return PolicySpec(spec, "plugin", target=arg)


def _build_plugin(p: PolicySpec, ctx, words: Words):
    """The user's own DraftPolicy: the callable `p.target` names, called with the PolicyContext."""
    import importlib

    assert p.target is not None
    module, _, name = p.target.rpartition(".")
    try:
        make = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UserError(f"policy '{p}': cannot import {p.target} ({e}); put its module on PYTHONPATH") from None
    policy = make(ctx) if callable(make) else None
    if not (hasattr(policy, "choose") and hasattr(policy, "observe")):
        raise UserError(f"policy '{p}': {p.target}(PolicyContext) must return a DraftPolicy (choose and observe)")
    return policy


def _build_oracle(p: PolicySpec, ctx, words: Words):
    from rlsched.policies.oracle import OraclePolicy, SeqOraclePolicy

    return SeqOraclePolicy(ctx) if p.per_row else OraclePolicy(ctx)


def _build_off(p: PolicySpec, ctx, words: Words):
    from rlsched.policies.draft import OffPolicy

    return OffPolicy()


@dataclass(frozen=True)
class Family:
    """One policy name: its grammar and a one-line description (the CLI's help), its parser
    and builder, and the engines that run it."""

    name: str
    usage: str
    summary: str
    parse: Callable[[str, str], PolicySpec | None]  # (whole text, text after NAME:) -> spec; None: not this grammar
    build: Callable  # (spec, PolicyContext, Words) -> DraftPolicy
    engines: tuple[str, ...] = ENGINES  # ("simulator",): reads the simulator's true acceptance
    priced: bool = False  # needs a cost model (twostate: only when it solves, i.e. without arguments)
    native: bool = False  # vLLM's own speculative_config says it (a fixed k, or k by batch size)
    guarded: bool = False  # held to plain decoding by default (`policies/guard.py`); UNGUARDED turns it off


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("off", "off", "plain decoding", _parse_off, _build_off, native=True),
        Family(
            "static",
            "static:K[:DRAFTER]",
            "K drafts every step (static:0 is off)",
            _parse_static,
            _build_static,
            native=True,
        ),
        Family(
            "tree",
            "tree:K:W:N[:DRAFTER]",
            "the same draft tree every step: K levels, W candidates a branch, "
            "the best N drafts verified (SGLang's steps, topk, num_draft_tokens - 1)",
            _parse_tree,
            _build_static,
            engines=("simulator", "local"),  # vLLM drafts chains
        ),
        Family(
            "goodput",
            "goodput[:REFRESH|:drain]",
            "the (drafter, k) with the most expected tokens per second "
            "of draft + verify, from the cost model and each row's acceptance",
            _parse_refresh("goodput"),
            _build_goodput,
            priced=True,
            guarded=True,
        ),
        Family(
            "seqgoodput",
            "seqgoodput[:REFRESH]",
            "every row its own draft length, priced by the cost model",
            _parse_refresh("seqgoodput"),
            _build_seqgoodput,
            priced=True,
            guarded=True,
        ),
        Family(
            "twostate",
            "twostate[:MAX_BATCH:K|:FILE]",
            "speculation off above a batch size, one k at or below it (solved over the cost model without arguments)",
            _parse_twostate,
            _build_twostate,
            priced=True,
            native=True,
            guarded=True,
        ),
        Family(
            "bandit",
            "bandit[:EPSILON]",
            "epsilon-greedy over (drafter, k) arms by measured tokens per second",
            _parse_bandit,
            _build_bandit,
            guarded=True,
        ),
        Family(
            "table",
            "table:FILE",
            "a learned lookup (`rlsched learn`) by batch size, acceptance and context",
            _parse_table,
            _build_file,
            native=True,
            guarded=True,
        ),
        Family(
            "plugin",
            "plugin:MODULE.NAME",
            "your own DraftPolicy: MODULE.NAME(PolicyContext) returns it (the module on PYTHONPATH)",
            _parse_plugin,
            _build_plugin,
        ),
        Family(
            "oracle",
            "oracle[:seq]",
            "goodput with the true acceptance (a yardstick)",
            _parse_oracle,
            _build_oracle,
            engines=("simulator",),
            priced=True,
        ),
    )
}


UNGUARDED = ":unguarded"  # after a guarded family's name or a policy file: no guard


def _guarded_names() -> str:
    return ", ".join(f.name for f in FAMILIES.values() if f.guarded)


def usage(engine: str = "simulator") -> str:
    """The policy names one engine runs, comma-separated (the CLI's help and error messages)."""
    names = [f.usage for f in FAMILIES.values() if engine in f.engines]
    return (
        ", ".join(names) + f", or a policy file (PATH.json); {UNGUARDED} after {_guarded_names()} "
        "or a file drops its guard against plain decoding"
    )


OFF_SPEC = PolicySpec("off", "off")  # plain decoding (a baseline's), without a text to parse


def parse_policy(text, engine: str = "simulator") -> PolicySpec:
    """The spec a policy name stands for; UserError, one line naming it (and the names
    `engine` runs), for a malformed one."""
    spec = str(text).strip()
    if not spec.isprintable():
        raise UserError(f"policy {spec!r} holds a line break or control character; give a name such as goodput")
    body = spec.removesuffix(UNGUARDED)
    guard = body == spec
    if body.endswith(UNGUARDED):
        raise UserError(f"policy '{spec}': {UNGUARDED} is given twice; give it once, as in goodput{UNGUARDED}")
    if body.endswith(".json") and ":" not in body:
        return PolicySpec(spec, None, file=body, guarded=guard)
    name, _, arg = body.partition(":")
    family = FAMILIES.get(name)
    if family is not None and not family.guarded and not guard:
        raise UserError(
            f"policy '{spec}': {name} runs unguarded; {UNGUARDED} follows {_guarded_names()} or a policy file only"
        )
    parsed = family.parse(spec, arg) if family is not None else None
    if family is None or parsed is None:
        raise UserError(f"unknown policy '{spec}'; choose from {usage(engine)}")
    return replace(parsed, guarded=family.guarded and guard)


def as_spec(policy: PolicySpec | str, engine: str = "simulator") -> PolicySpec:
    """`policy` itself when parsed, else its text parsed: commands parse once where the name
    enters and pass the spec down; tests and scripts may pass the text."""
    return policy if isinstance(policy, PolicySpec) else parse_policy(policy, engine)


def make_draft_policy(spec: PolicySpec | str, ctx, words: Words = SIMULATOR):
    """A DraftPolicy from its parsed spec (or its text), checked against the PolicyContext's
    drafters and k_max in the command's `words`, built by its family's builder; held to plain
    decoding by `policies/guard.Guarded` where the spec is guarded and a cost model prices it, in
    the simulator (`ctx.calibrate` off: step times are the cost model's). On measured step times
    the guard mistook a loaded machine's slow steps for speculation losing and held plain
    decoding, so the executor runs the policies bare."""
    p = as_spec(spec).check(ctx.drafters, ctx.k_max, words)
    if not p.drafts:
        return _build_off(p, ctx, words)
    build = FAMILIES[p.family].build if p.family is not None else _build_file
    policy = build(p, ctx, words)
    if p.guarded and ctx.cost is not None and not ctx.calibrate:  # (it prices plain decoding by the cost model)
        from rlsched.policies.guard import Guarded

        return Guarded(policy, ctx)
    return policy
