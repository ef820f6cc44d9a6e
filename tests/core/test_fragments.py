"""The fragment plan: balanced and strided packing, determinism, schedule, serialization."""

from __future__ import annotations

import pytest
from diloco_core.fragments import FragmentPlan, build_plan, layer_index, plan_differences
from hypothesis import given, settings
from hypothesis import strategies as st

GPT = [
    ("wte.weight", (256, 32)),
    ("wpe.weight", (64, 32)),
    *[(f"h.{i}.attn.weight", (32, 96)) for i in range(4)],
    *[(f"h.{i}.mlp.weight", (32, 128)) for i in range(4)],
    *[(f"h.{i}.ln.weight", (32,)) for i in range(4)],
    ("ln_f.weight", (32,)),
]


def test_embeddings_get_their_own_fragment_and_dense_ones_are_balanced() -> None:
    plan = build_plan(GPT, num_fragments=3, inner_steps=12, embedding_names={"wte.weight", "wpe.weight"})
    assert plan.fragments[0].kind == "embedding"
    assert set(plan.fragments[0].names) == {"wte.weight", "wpe.weight"}
    dense_sizes = [f.numel for f in plan.fragments[1:]]
    assert all(f.kind == "dense" for f in plan.fragments[1:])
    assert max(dense_sizes) - min(dense_sizes) <= 32 * 128  # within one largest tensor
    assert plan.num_params == sum(_numel(s) for _, s in GPT)
    assert [f.offset for f in plan.fragments] == [0, 4, 8]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_strided_puts_layer_i_into_dense_fragment_i_mod_p() -> None:
    plan = build_plan(GPT, num_fragments=3, inner_steps=8, strategy="strided", embedding_names={"wte.weight"})
    for i in range(4):
        # dense fragments are 1..2, so layer i lands in fragment 1 + i % 2
        assert plan.fragment_of(f"h.{i}.attn.weight") == 1 + i % 2
        assert plan.fragment_of(f"h.{i}.mlp.weight") == 1 + i % 2
    assert layer_index("model.layers.12.mlp.up.weight") == 12
    assert layer_index("blocks.3.attn.qkv") == 3
    assert layer_index("lm_head.weight") is None


def test_single_fragment_holds_everything_and_is_always_dense() -> None:
    plan = build_plan(GPT, num_fragments=1, inner_steps=5, overlap=0, embedding_names={"wte.weight"})
    assert len(plan.fragments) == 1
    assert plan.fragments[0].kind == "dense"
    assert plan.fragments[0].offset == 0
    assert plan.fragments[0].mean_tensors == ("wte.weight",)  # still merged as an embedding
    assert FragmentPlan.from_dict(plan.to_dict()) == plan
    assert not plan.is_due(0, 4)
    assert plan.is_due(0, 5)


def test_only_a_fragment_shared_by_embeddings_and_dense_tensors_lists_mean_tensors() -> None:
    plan = build_plan(GPT, num_fragments=3, inner_steps=4, embedding_names={"wte.weight", "wpe.weight"})
    assert [f.mean_tensors for f in plan.fragments] == [(), (), ()]
    assert all("mean_tensors" not in f for f in plan.to_dict()["fragments"])  # hashes of such plans unchanged
    bad = build_plan(GPT, num_fragments=1, inner_steps=4, embedding_names={"wte.weight"}).to_dict()
    bad["fragments"][0]["mean_tensors"] = ["nope"]
    with pytest.raises(ValueError, match="mean_tensors"):
        FragmentPlan.from_dict(bad)


def test_more_fragments_than_inner_steps_are_refused_as_their_offsets_would_collide() -> None:
    with pytest.raises(ValueError, match="4 fragments need at least as many inner steps"):
        build_plan(GPT, num_fragments=4, inner_steps=2)  # offsets 0, 0, 1, 1
    offsets = [f.offset for f in build_plan(GPT, num_fragments=4, inner_steps=4).fragments]
    assert offsets == [0, 1, 2, 3]


def test_plan_round_trips_through_dict_and_hash_detects_changes() -> None:
    plan = build_plan(GPT, num_fragments=4, inner_steps=16, overlap=2, embedding_names={"wte.weight"})
    again = FragmentPlan.from_dict(plan.to_dict())
    assert again == plan
    assert again.hash() == plan.hash()
    assert len(plan.hash()) == 64
    other = build_plan(GPT, num_fragments=4, inner_steps=16, overlap=1, embedding_names={"wte.weight"})
    assert other.hash() != plan.hash()
    bigger = build_plan([*GPT[:-1], ("ln_f.weight", (33,))], 4, 16, 2, embedding_names={"wte.weight"})
    assert bigger.hash() != plan.hash()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("fragments"), "malformed"),
        (lambda d: d.update(inner_steps=0), "integer >= 1"),
        (lambda d: d["fragments"][0].update(kind="weird"), "unknown kind"),
        (lambda d: d["fragments"][1]["tensors"].append(d["fragments"][0]["tensors"][0]), "appears twice"),
        (lambda d: d["fragments"][0]["tensors"][0].__setitem__(1, [-1]), "integer >= 0"),
        (lambda d: d.update(format=99), "unsupported plan format"),
        (lambda d: d.update(strategy="zigzag"), "strategy 'zigzag'"),
        (lambda d: d.update(overlap=4), "overlap 4"),
    ],
)
def test_from_dict_rejects_malformed_plans(mutate, match) -> None:  # type: ignore[no-untyped-def]
    d = build_plan(GPT, num_fragments=2, inner_steps=4, embedding_names={"wte.weight"}).to_dict()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        FragmentPlan.from_dict(d)


def test_bad_arguments_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="would be empty"):
        build_plan([("a", (2,)), ("b", (3,))], num_fragments=3, inner_steps=4)
    with pytest.raises(ValueError, match="overlap"):
        build_plan(GPT, num_fragments=2, inner_steps=4, overlap=4)
    with pytest.raises(ValueError, match="duplicate"):
        build_plan([("a", (2,)), ("a", (3,))], num_fragments=1, inner_steps=4)
    with pytest.raises(ValueError, match="embedding names not in the model"):
        build_plan(GPT, num_fragments=2, inner_steps=4, embedding_names={"nope"})
    with pytest.raises(ValueError, match="strategy"):
        build_plan(GPT, num_fragments=2, inner_steps=4, strategy="random")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="not in the fragment plan"):
        build_plan(GPT, num_fragments=2, inner_steps=4).fragment_of("missing")


shapes = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)
models = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}(\.[0-9])?\.w", fullmatch=True), shapes, min_size=2, max_size=25
)


@settings(max_examples=60, deadline=None)
@given(models, st.integers(1, 4), st.randoms(use_true_random=False), st.sampled_from(["balanced", "strided"]))
def test_plan_is_deterministic_whatever_the_input_order(model, p, rnd, strategy) -> None:  # type: ignore[no-untyped-def]
    items = list(model.items())
    p = min(p, len(items))
    emb = {items[0][0]} if p > 1 else set()
    shuffled = items[:]
    rnd.shuffle(shuffled)
    try:
        a = build_plan(items, p, inner_steps=8, strategy=strategy, embedding_names=emb)
    except ValueError:  # strided packing can leave a fragment empty: refused the same way both times
        with pytest.raises(ValueError, match="would be empty"):
            build_plan(shuffled, p, inner_steps=8, strategy=strategy, embedding_names=emb)
        with pytest.raises(ValueError, match="would be empty"):
            build_plan(items, p, inner_steps=8, strategy=strategy, embedding_names=emb)
        return
    b = build_plan(shuffled, p, inner_steps=8, strategy=strategy, embedding_names=emb)
    assert a == b
    assert a.hash() == b.hash()
    assert sorted(n for f in a.fragments for n in f.names) == sorted(model)
    assert len({f.offset for f in a.fragments}) == len(a.fragments)


def test_plan_differences_name_each_setting_with_both_values() -> None:
    shapes = [("wte.weight", (16, 4)), ("h.0.w", (4, 4)), ("h.1.w", (4, 4))]
    job = build_plan(shapes, 2, 8, 1, embedding_names=("wte.weight",))
    assert plan_differences(job, job) == []
    other = build_plan(shapes, 3, 16, 1, embedding_names=("wte.weight",))
    assert plan_differences(job, other) == [
        "inner steps H: the job's 8, this learner's 16 (inner_steps (--inner-steps, spec.diloco.innerSteps))",
        "fragments P: the job's 2, this learner's 3 (fragments (--fragments, spec.diloco.fragments))",
    ]
    wider = build_plan([("wte.weight", (16, 8)), ("h.0.w", (4, 4)), ("h.2.w", (4, 4))], 2, 8, 1,
                       embedding_names=("wte.weight",))  # fmt: skip
    (model,) = plan_differences(job, wider)
    assert model.startswith(
        "model: this learner's lacks ['h.1.w']; adds ['h.2.w']; wte.weight is (16, 8), the job's (16, 4)"
    )
