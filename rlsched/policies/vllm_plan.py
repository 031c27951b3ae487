"""What a drafting policy is in vLLM's terms, without vLLM or torch: its draft length
(`num_speculative_tokens`) and, where the policy picks the length by batch size, vLLM's own
`num_speculative_tokens_per_batch_size` table. Used by the vLLM rollout backend and by the
planner, which writes vLLM engine arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlsched.errors import UserError
from rlsched.policies.registry import PolicySpec, as_spec, run_words

TABLE_FIELD = "num_speculative_tokens_per_batch_size"
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _check_table(table, where: str) -> list[list[int]]:
    ok = (
        isinstance(table, list)
        and table
        and all(
            isinstance(e, (list, tuple))
            and len(e) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
            for e in table
        )
    )
    if not ok:
        raise UserError(
            f"policy {where}: {TABLE_FIELD} must be a non-empty list of [start_bs, end_bs, K] whole "
            "numbers (write it with `rlsched learn --vllm-table FILE`)"
        )
    table = sorted([list(e) for e in table])
    prev = 0
    for lo, hi, k in table:
        if lo < 1 or hi < lo or k < 0 or lo <= prev:
            raise UserError(
                f"policy {where}: {TABLE_FIELD} ranges must be 1 <= start_bs <= end_bs, K >= 0, "
                f"not overlapping (got [{lo}, {hi}, {k}])"
            )
        prev = hi
    if table[0][0] != 1:
        raise UserError(f"policy {where}: {TABLE_FIELD} must start at batch size 1 (vLLM needs a K for every batch)")
    return table


def _table_from_file(policy: str, path: str, max_batch: int) -> list[list[int]] | None:
    """vLLM's batch-size table from a table file or a two-state policy file; None for a learned
    table policy file (it runs as rlsched's policy)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"policy '{policy}': file '{path}' does not exist; write one with `rlsched learn --vllm-table {path}`"
        )
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        why = "nested too deep" if isinstance(e, RecursionError) else e
        raise UserError(f"policy '{policy}': '{path}' is not valid JSON ({why})") from None
    if isinstance(data, dict) and data.get("format") == "rlsched-policy":
        from rlsched.policies.policyfile import load_policy_file

        pf = load_policy_file(p)
        if pf.kind != "twostate":
            return None  # a learned table (by acceptance, context): rlsched's policy, through the hook
        if "width" in pf.params:
            raise UserError(
                f"policy '{policy}': '{path}' drafts a tree {pf.params['width']} wide; vLLM drafts "
                "chains here: learn a chain policy (speculation.width_max: 1)"
            )
        return _twostate_table(pf.params["max_batch_on"], pf.params["k"], max_batch)
    if isinstance(data, dict) and TABLE_FIELD in data:
        data = data[TABLE_FIELD]
    return _check_table(data, f"'{policy}'")


def _twostate_table(on: int, k: int, max_batch: int) -> list[list[int]]:
    if on <= 0:
        return [[1, max(1, max_batch), 0]]
    if on >= max_batch:
        return [[1, on, k]]
    return [[1, on, k], [on + 1, max_batch, 0]]


def speculative_plan(policy: PolicySpec | str, have: str, *, k_max: int, max_batch: int) -> dict | None:
    """What `policy` is in vLLM's terms with a drafter of kind `have` (off, model, eagle, ngram,
    suffix: `executor.setup.drafter_kind`): None for plain decoding, else
    {"k": num_speculative_tokens, "table": [[start_bs, end_bs, K], ...] or None, "drafter":
    "model" | "eagle" | "ngram", "native": bool}. Native: vLLM's own config says the draft length (static
    K, a batch-size table); else rlsched's policy chooses it every step (`vllm_hook`) up to
    k = k_max. UserError (naming `policy`) for what cannot run here."""
    if have == "suffix":
        raise UserError(
            "drafter suffix runs on the local backend only (vLLM's own suffix method needs the "
            "arctic-inference package); set rollout.backend local or drafter ngram"
        )
    p = as_spec(policy, "vllm").check(() if have == "off" else (have,), k_max, run_words("vllm"))
    if not p.drafts:
        return None
    if p.family == "static":
        return {"k": p.k, "table": None, "drafter": have, "native": True}
    table = None
    if p.family == "twostate" and p.max_batch is not None:
        table = _twostate_table(p.max_batch, p.k, max_batch)
    elif p.file is not None:
        table = _table_from_file(p.text, p.file, max_batch)
    if table is None:
        return {"k": k_max, "table": None, "drafter": have, "native": False}
    table = [[lo, hi, min(k, k_max)] for lo, hi, k in table]
    k = max(e[2] for e in table)
    if k == 0:
        return None
    return {"k": k, "table": None if all(e[2] == k for e in table) else table, "drafter": have, "native": True}
