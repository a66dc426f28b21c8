"""Recipe loading, selectors, rule composition and error messages (no model needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import kvpolicy
from kvpolicy.errors import KVPolicyError, RecipeError
from kvpolicy.recipe import builtin_recipe_names, load_recipe, with_budget
from kvpolicy.recipe.budget import UNBOUNDED, Budget

CORE = ["full", "h2o", "mixed", "streaming", "window"]
BUILTINS = builtin_recipe_names()  # every shipped recipe must load and resolve


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def policies(plan) -> list[list[str]]:
    return [[head.policy for head in layer.heads] for layer in plan.layers]


def error(tmp_path: Path, text: str, layers: int = 30, heads: int = 3) -> str:
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path).resolve(layers, heads)
    message = str(info.value)
    assert str(path) in message
    return message


# --- built-in recipes -------------------------------------------------------------------------


def test_builtin_names():
    assert set(CORE) <= set(builtin_recipe_names())


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_loads_and_resolves(name):
    recipe = load_recipe(name)
    assert recipe.source == f"<builtin:{name}>"
    assert recipe.description
    plan = recipe.resolve(30, 3)
    assert len(plan.layers) == 30 and all(len(layer.heads) == 3 for layer in plan.layers)
    assert plan.source == recipe.source and plan.backend == "auto"


def test_builtin_by_path():
    path = Path(kvpolicy.__file__).parent.parent / "recipes" / "h2o.yaml"
    recipe = load_recipe(path)
    assert recipe.source == str(path)
    head = recipe.resolve(2, 1).layers[0].heads[0]
    assert head.policy == "h2o" and head.params.recent_ratio == 0.5 and head.budget == Budget(ratio=0.2)


def test_full_is_unbounded():
    plan = load_recipe("full").resolve(4, 2)
    assert all(head.budget == UNBOUNDED for layer in plan.layers for head in layer.heads)


def test_mixed():
    plan = load_recipe("mixed").resolve(30, 3)
    grid = policies(plan)
    for layer, row in enumerate(grid):
        for head, policy in enumerate(row):
            if layer < 2:
                expected = "full"
            elif (layer, head) == (10, 1):
                expected = "streaming"
            else:
                expected = "h2o"
            assert policy == expected, (layer, head)
    streaming = plan.layers[10].heads[1]
    assert streaming.params.sinks == 4 and streaming.budget == Budget(ratio=0.2)
    assert plan.layers[0].heads[0].budget == UNBOUNDED
    assert type(plan.layers[5].heads[0].params).__name__ == "H2OParams"


def test_dict_source():
    recipe = load_recipe({"kvpolicy": 1, "policy": "window", "budget": {"tokens": 64}})
    assert recipe.source == "<dict>"
    assert recipe.resolve(1, 1).layers[0].heads[0].budget == Budget(tokens=64)


def test_with_budget():
    recipe = load_recipe("h2o")
    swept = with_budget(recipe, Budget(tokens=128, slack=8))
    assert recipe.budget == Budget(ratio=0.2)
    assert swept.resolve(1, 1).layers[0].heads[0].budget == Budget(tokens=128, slack=8)
    with pytest.raises(TypeError):
        with_budget(recipe, {"tokens": 1})


def test_a_budget_sweep_keeps_the_recipes_slack_and_tiers():
    """compare swaps in each --budgets amount: Scissorhands still drops 16 at once, h2o-mixed still moves 16 down a tier
    at once (a sweep dropped both slacks, and h2o-mixed ranked its layers at every token)."""
    scissorhands = with_budget(load_recipe("scissorhands"), Budget(ratio=0.1))
    assert scissorhands.budget == Budget(ratio=0.1, slack=16)
    mixed = with_budget(load_recipe("h2o-mixed"), Budget(memory=0.3))
    assert mixed.budget.slack == 16 and mixed.budget.tiers == load_recipe("h2o-mixed").budget.tiers
    assert with_budget(load_recipe("scissorhands"), Budget(ratio=0.1, slack=4)).budget.slack == 4  # its own wins


# --- rules and selectors ----------------------------------------------------------------------


def test_later_rules_win(tmp_path):
    recipe = load_recipe(
        write(
            tmp_path,
            """
        kvpolicy: 1
        budget: {ratio: 0.2, slack: 16, align: 32}
        policy: h2o
        layers:
          - {layers: "0-3", policy: full}
          - {layers: "2-", policy: window, budget: {tokens: 256}}
        heads:
          - {layers: "3", heads: 0, policy: streaming}
          - {layers: all, heads: "*", params: {}}
    """,
        )
    )
    plan = recipe.resolve(6, 2)
    assert policies(plan) == [
        ["full"] * 2,
        ["full"] * 2,
        ["window"] * 2,
        ["streaming", "window"],
        ["window"] * 2,
        ["window"] * 2,
    ]
    assert plan.layers[4].heads[0].budget == Budget(tokens=256, slack=16, align=32)  # slack and align inherited
    assert plan.layers[3].heads[0].params.sinks == 4  # defaults of the new policy
    assert plan.layers[3].heads[0].budget == Budget(tokens=256, slack=16, align=32)
    assert plan.layers[0].heads[0].budget == UNBOUNDED


def test_params_merge(tmp_path):
    recipe = load_recipe(
        write(
            tmp_path,
            """
        kvpolicy: 1
        budget: {tokens: 100}
        policy: h2o
        params: {recent_ratio: 0.3, accumulate: mean}
        layers:
          - {layers: 1, params: {recent_ratio: 0.1}}
          - {layers: 2, policy: h2o}
          - {layers: 3, policy: streaming}
          - {layers: 3, policy: h2o}
          - {layers: 4, budget: {tokens: 10, slack: 2}}
    """,
        )
    )
    heads = [layer.heads[0] for layer in recipe.resolve(5, 1).layers]
    assert (heads[0].params.recent_ratio, heads[0].params.accumulate) == (0.3, "mean")
    assert (heads[1].params.recent_ratio, heads[1].params.accumulate) == (0.1, "mean")  # merged
    assert heads[2].params.recent_ratio == 0.3  # same policy: params kept
    assert (heads[3].params.recent_ratio, heads[3].params.accumulate) == (0.5, "sum")  # changed: defaults
    assert heads[4].budget == Budget(tokens=10, slack=2)
    assert isinstance(heads[0].params.recent_ratio, float)


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ('"2-"', [2, 3, 4, 5, 6, 7, 8, 9]),
        ('"-1"', [9]),
        ("-2", [8]),
        ('"0,2,5-7"', [0, 2, 5, 6, 7]),
        ('[1, "3-4", -1]', [1, 3, 4, 9]),
        ("4", [4]),
        ("all", list(range(10))),
        ('"*"', list(range(10))),
    ],
)
def test_layer_selectors(tmp_path, selector, expected):
    recipe = load_recipe(
        write(
            tmp_path,
            f"""
        kvpolicy: 1
        budget: {{tokens: 8}}
        policy: window
        layers:
          - {{layers: {selector}, policy: full}}
    """,
        )
    )
    grid = policies(recipe.resolve(10, 1))
    assert [i for i, row in enumerate(grid) if row == ["full"]] == expected


def test_head_selectors(tmp_path):
    recipe = load_recipe(
        write(
            tmp_path,
            """
        kvpolicy: 1
        budget: {tokens: 8}
        policy: window
        heads:
          - {heads: "-1", policy: full}
          - {layers: [0], heads: "0,2", policy: streaming}
    """,
        )
    )
    assert policies(recipe.resolve(2, 4)) == [
        ["streaming", "window", "streaming", "full"],
        ["window", "window", "window", "full"],
    ]


# --- errors -----------------------------------------------------------------------------------


def test_malformed_yaml(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        policy: h2o
        budget: {ratio: 0.2
        layers: []
    """,
    )
    assert "invalid YAML" in message
    assert ":4:" in message or ":3:" in message


def test_malformed_yaml_indent(tmp_path):
    message = error(tmp_path, "kvpolicy: 1\npolicy: h2o\n  params: x\n")
    assert "r.yaml:3:" in message and "invalid YAML" in message


def test_unknown_top_level_key(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        polcy: h2o
    """,
    )
    assert "r.yaml:2: polcy: unknown key" in message and 'did you mean "policy"' in message


def test_unknown_rule_key(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        layers:
          - layers: 0
            polciy: full
    """,
    )
    assert "r.yaml:4: layers[0].polciy" in message and 'did you mean "policy"' in message


def test_unknown_policy(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        budget: {ratio: 0.2}
        policy: h20
    """,
    )
    assert "r.yaml:3: policy:" in message
    for name in ("full", "h2o", "streaming", "window"):
        assert name in message


def test_unknown_param(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        budget: {ratio: 0.2}
        policy: h2o
        params:
          recent_ratoi: 0.5
    """,
    )
    assert 'r.yaml:5: params.recent_ratoi: unknown parameter of policy "h2o"' in message
    assert (
        'did you mean "recent_ratio"' in message and "Known parameters: accumulate, decay, recent_ratio" in message
    )


def test_param_wrong_type(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        budget: {ratio: 0.2}
        policy: h2o
        params: {recent_ratio: half}
    """,
    )
    assert "r.yaml:4: params.recent_ratio: expected float" in message


def test_param_invalid_value(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        budget: {ratio: 0.2}
        policy: h2o
        layers:
          - {layers: 3, params: {recent_ratio: 2}}
    """,
    )
    assert "r.yaml:5: layers[0].params" in message and "recent_ratio must be in [0, 1]" in message


def test_param_for_policy_without_params(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        params: {sinks: 4}
    """,
    )
    assert "r.yaml:2: params.sinks" in message and 'Policy "full" takes no parameters' in message


@pytest.mark.parametrize(
    ("budget", "key"),
    [
        ("{ratio: 0}", "ratio"),
        ("{ratio: 1.5}", "ratio"),
        ("{tokens: 0}", "tokens"),
        ("{tokens: 2.5}", "tokens"),
        ("{ratio: 0.2, slack: -1}", "slack"),
        ("{ratio: 0.2, align: 2.5}", "align"),
    ],
)
def test_bad_budget(tmp_path, budget, key):
    message = error(
        tmp_path,
        f"""
        kvpolicy: 1
        policy: h2o
        budget: {budget}
    """,
    )
    assert f"r.yaml:3: budget.{key}: must be" in message


def test_budget_needs_exactly_one(tmp_path):
    assert "exactly one of ratio/tokens" in error(tmp_path, "kvpolicy: 1\nbudget: {ratio: 0.2, tokens: 5}\n")
    assert "exactly one of ratio/tokens" in error(tmp_path, "kvpolicy: 1\nbudget: {slack: 5}\n")


def test_bounded_policy_without_budget(tmp_path):
    message = error(tmp_path, "kvpolicy: 1\npolicy: window\n")
    assert "r.yaml:2: budget" in message and "no budget" in message


@pytest.mark.parametrize(
    ("selector", "valid"),
    [('"28-31"', "layers 0-29"), ("30", "layers 0-29"), ('"-31"', "layers 0-29"), ('"40-"', "layers 0-29")],
)
def test_layer_selector_out_of_range(tmp_path, selector, valid):
    message = error(
        tmp_path,
        f"""
        kvpolicy: 1
        layers:
          - {{layers: {selector}, policy: full}}
    """,
    )
    assert "r.yaml:3: layers[0].layers" in message and "out of range" in message and valid in message


def test_head_selector_out_of_range(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        heads:
          - {layers: 10, heads: [0, 5], policy: full}
    """,
    )
    assert "r.yaml:3: heads[0].heads" in message and "KV heads 0-2" in message


def test_builtin_out_of_range_at_resolve():
    with pytest.raises(RecipeError, match=r"mixed\.yaml:\d+: heads\[0\]\.layers.*layers 0-3"):
        load_recipe("mixed").resolve(4, 3)


def test_bad_selector_syntax(tmp_path):
    message = error(
        tmp_path,
        """
        kvpolicy: 1
        layers:
          - {layers: "3-1", policy: full}
    """,
    )
    assert "r.yaml:3: layers[0].layers: cannot read selector '3-1'" in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert str(path) in message and all(name in message for name in CORE)


def test_unknown_builtin_name():
    with pytest.raises(RecipeError, match=r'did you mean "h2o".*Built-in recipes: adakv, d2o, d2o-merge, expected-attention, fastgen, fastgen-smollm2, full, h2o'):
        load_recipe("h2")


@pytest.mark.parametrize(("text", "line"), [("kvpolicy: 2\n", 1), ("name: x\n", None)])
def test_schema_version(tmp_path, text, line):
    message = error(tmp_path, text)
    assert "schema version" in message and "kvpolicy: 1" in message
    if line:
        assert "r.yaml:1: kvpolicy: unsupported schema version 2" in message


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just text\n", ""])
def test_top_level_not_mapping(tmp_path, text):
    assert "top level must be a mapping" in error(tmp_path, text)


def test_unknown_backend(tmp_path):
    message = error(tmp_path, "kvpolicy: 1\nbackend: trtion\n")
    assert "r.yaml:2: backend" in message and 'did you mean "triton"' in message


# --- threshold budgets ---------------------------------------------------------------------------


def test_a_threshold_budget_is_read_described_and_kept_by_a_sweep():
    recipe = load_recipe("h2o-threshold")
    assert recipe.budget == Budget(ratio=0.3, threshold=1.0)
    assert recipe.budget.describe() == "tokens scoring >= 1x the mean, at most 0.3 of prompt"
    assert with_budget(recipe, Budget(ratio=0.1)).budget == Budget(ratio=0.1, threshold=1.0)
    with pytest.raises(KVPolicyError, match="a budget in bytes cannot size"):
        with_budget(recipe, Budget(memory=0.2))


@pytest.mark.parametrize(("budget", "line", "words"), [
    ("{threshold: 1.0}", 3, "budget.threshold: a threshold needs a cap"),
    ("{ratio: 0.3, threshold: -1}", 3, "budget.threshold: must be a number > 0, got -1"),
    ("{ratio: 0.3, threshold: high}", 3, "budget.threshold: must be a number > 0"),
    ("{memory: 0.3, threshold: 1.0}", 3, "precision tiers and memory budgets cannot size"),
])
def test_a_bad_threshold_names_its_line_and_the_fix(tmp_path, budget, line, words):
    message = error(tmp_path, f"kvpolicy: 1\npolicy: h2o\nbudget: {budget}\n")
    assert f":{line}: " in message and words in message, message
