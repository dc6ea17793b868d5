"""apply_activation_memory on transformers models (small random configs, CPU).

Five architectures: Llama, Qwen2, GPT-2 (dropout on, blocks in ``transformer.h``),
Mistral with its default flags (``use_cache`` on, a sliding window shorter than the
sequence) and Mixtral (mixture of experts). For each: ``find_layers`` names the decoder
blocks; every strategy trains 3 steps with losses and gradients bitwise equal to the
plain model; ``remove_activation_memory`` gives back the original modules. Then the KV
cache in training (every plan trains without one, the config is never edited, a cache
passed to a recomputing plan is refused) and Hugging Face gradient checkpointing turned
on after apply (refused). T5 (encoder-decoder, attention scores written in place after
torch.matmul) trains bitwise under checkpoint, swap and the selective plans. Sizes are tiny (hidden 16 to 32, 2 to 6 layers, 8 to 12
tokens) so the whole file runs in seconds.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hyper_parallel.core.activation_checkpoint import (  # noqa: E402
    STRATEGIES,
    CheckpointPolicy,
    SwapManager,
    apply_activation_memory,
    find_layers,
    remove_activation_memory,
)

VOCAB, SEQ, BATCH, LAYERS, STEPS = 64, 12, 2, 3, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
             tie_word_embeddings=False)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=LAYERS, n_head=2,
                                     n_positions=32)  # dropout 0.1 everywhere (default)
    assert config.resid_pdrop > 0 and config.attn_pdrop > 0
    return transformers.GPT2LMHeadModel(config)


def mistral():
    config = transformers.MistralConfig(**SMALL, sliding_window=4)  # window < SEQ
    assert config.use_cache is True  # the default, kept
    return transformers.MistralForCausalLM(config)


def mixtral():
    config = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


MODELS = {
    "llama": (llama, "model.layers"),
    "qwen2": (qwen2, "model.layers"),
    "gpt2": (gpt2, "transformer.h"),
    "mistral": (mistral, "model.layers"),
    "mixtral": (mixtral, "model.layers"),
}
PLANS = ("checkpoint", "selective", "swap", "mixed", "selective_swap")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These matrices are tiny: with several intra-op threads on a busy machine, OpenMP's
    spinning makes each op wait for a descheduled thread (measured: 5x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def built():
    """One randomly initialised model per architecture (deep-copied per test)."""
    out = {}
    for name, (make, _) in MODELS.items():
        torch.manual_seed(0)
        model = make()
        model.train()
        out[name] = model
    return out


def train(model, batches, seed: int = 0, **call):
    """Three SGD steps; (losses, gradients of every step). ``call``: more keyword arguments
    of the model's call."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step, tokens in enumerate(batches):
        torch.manual_seed(seed + step)  # dropout draws the same numbers in both runs
        out = model(input_ids=tokens, labels=tokens, **call)
        out.loss.backward()
        losses.append(out.loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


@pytest.mark.parametrize("arch", list(MODELS))
def test_find_layers_names_the_decoder_blocks(arch, built):
    model = built[arch]
    prefix = MODELS[arch][1]
    assert find_layers(model) == [f"{prefix}.{i}" for i in range(LAYERS)]


@pytest.mark.parametrize("arch", list(MODELS))
def test_every_strategy_bitwise_for_three_steps(arch, built, host_swap):
    data = batches()
    # Every plan trains without a KV cache (config.use_cache left as it is): each is
    # compared with the plain model under use_cache=False (with the cache on, attention
    # reads keys and values through the cache's concatenation, which can change the last
    # bits).
    plain = copy.deepcopy(built[arch])
    plain.config.use_cache = False
    ref_losses, ref_grads = train(plain, data)
    keys = list(built[arch].state_dict())
    for plan in PLANS:
        model = copy.deepcopy(built[arch])
        originals = [model.get_submodule(n) for n in find_layers(model)]
        SwapManager().reset_stats()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the config default asks for nothing: no warning
            report = apply_activation_memory(model, plan)
        assert [e.name for e in report] == find_layers(model)
        assert list(model.state_dict()) == keys
        losses, grads = train(model, data)
        for step in range(STEPS):
            assert torch.equal(losses[step], ref_losses[step]), (arch, plan, step)
            for a, b in zip(grads[step], ref_grads[step]):
                assert torch.equal(a, b), (arch, plan, step, (a - b).abs().max())
        stats = SwapManager().stats()
        if STRATEGIES[plan].swaps:  # 3 layers: at least one swapping layer has a successor
            assert stats["offload_bytes"] > 0, (arch, plan)
            assert stats["reload_bytes"] == stats["offload_bytes"]
        assert remove_activation_memory(model)
        assert [model.get_submodule(n) for n in find_layers(model)] == originals
        assert model.config.use_cache == built[arch].config.use_cache  # never edited


def test_the_config_is_never_edited(built):
    model = copy.deepcopy(built["mistral"])
    assert model.config.use_cache is True
    before = model.config.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the config is left alone
        report = apply_activation_memory(model, "checkpoint")
        assert report.use_cache_disabled
        assert "no KV cache in training forwards" in str(report)
        apply_activation_memory(model, "swap")
    assert model.config.to_dict() == before
    assert not apply_activation_memory(model, "none").use_cache_disabled  # nothing changed
    remove_activation_memory(model)
    assert model.config.to_dict() == before


def test_mistral_default_config_recompute_trains(built):
    """The failure this guards against: with use_cache on, recompute appends to the KV
    cache a second time and the recomputed attention sees other shapes."""
    model = copy.deepcopy(built["mistral"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_activation_memory(model, "checkpoint")
    tokens = batches()[0]
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")
def test_hf_gradient_checkpointing_is_refused(built):
    model = copy.deepcopy(built["llama"])
    model.gradient_checkpointing_enable()
    before = [type(model.get_submodule(n)) for n in find_layers(model)]
    with pytest.raises(ValueError, match=r"model.gradient_checkpointing_disable\(\)"):
        apply_activation_memory(model, "swap")
    assert [type(model.get_submodule(n)) for n in find_layers(model)] == before
    model.gradient_checkpointing_disable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_activation_memory(model, "checkpoint")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_explicit_use_cache_in_a_training_forward_is_turned_off(attn):
    # A training forward that passes use_cache=True after a recomputing plan: the recompute
    # would append the layer's keys and values to the KV cache a second time (sdpa: a
    # cache of 20 positions for 10 tokens; eager with a padding mask: a shape error in
    # backward). The forward's argument is turned off (warned), as transformers' own
    # gradient checkpointing does; gradients stay bitwise equal to the plain model's.
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn))
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 64, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_activation_memory(model, "checkpoint")
    ref.train()
    model.train()
    ref(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    with pytest.warns(UserWarning, match="hyper_parallel: use_cache=True passed to a forward with grad on"):
        out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=True)
    out.loss.backward()
    assert getattr(out, "past_key_values", None) is None
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)
    # eval keeps the cache
    model.eval()
    with torch.no_grad():
        cached = model(input_ids=ids, attention_mask=mask, use_cache=True)
    assert cached.past_key_values.get_seq_length() == 10
    assert remove_activation_memory(model)
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_an_eval_mode_forward_with_grad_under_a_recomputing_plan_builds_no_cache(arch):
    # An eval-mode model differentiated (input gradients, dropout-free fine-tuning): the
    # layers recompute whatever the mode, so the KV cache transformers builds in eval mode
    # was appended to a second time by the recompute (Llama with a padding mask: a shape
    # error in backward; T5: CheckpointError, 51 vs 47 tensors; tester, session 19). Such
    # forwards now run without the cache, as training forwards do: gradients bitwise those
    # of the plain model with use_cache=False. A plan that recomputes nothing leaves an
    # eval forward's cache alone.
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        ref = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2))
    else:
        ref = tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.randint(3, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref.eval()
    ref(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    for plan in ("checkpoint", "selective", "swap"):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            apply_activation_memory(model, plan)
        model.eval()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        if plan == "swap":  # recomputes nothing: the eval forward keeps its cache
            assert out.past_key_values is not None
            continue
        assert getattr(out, "past_key_values", None) is None, plan
        for p, q in zip(ref.parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), plan


def tiny_llama(layers=4, device="cpu", **config):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **config))
    return model.to(device).train()


class _PlannerLikePlan:
    """A planner's plan (LayerPlan protocol) that mixes swap and recompute."""

    def __init__(self, n):
        self.strategies = {f"model.layers.{i}": ("swap", "checkpoint", "selective_swap")[i % 3]
                           for i in range(n)}


def _step_stats(model, ids, **kwargs):
    SwapManager().reset_stats()
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    SwapManager().synchronize()
    stats = SwapManager().stats()
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    return out, (stats["offload_bytes"], stats["reload_bytes"], stats["skipped"]), grads


@pytest.mark.parametrize("plan", ["swap", "selective_swap", "planner"])
def test_swap_plans_train_without_a_kv_cache(plan, dev):
    # Swap plans used to leave use_cache on: a training forward built a KV cache holding
    # every layer's keys and values (counted as offloaded: on hpsim with 6 Llama layers
    # 5.68 MB saved against 4.24 MB with use_cache=False). Now every plan trains without
    # one: the bytes the engine moves and skips are those of the use_cache=False model, the
    # gradients bitwise those of the plain model with use_cache=False.
    ids = torch.randint(0, VOCAB, (2, 12)).to(dev)
    ref = tiny_llama(6, dev, use_cache=False)
    _, _, ref_grads = _step_stats(ref, ids)
    runs = {}
    for use_cache in (True, False):
        model = tiny_llama(6, dev, use_cache=use_cache)
        apply_activation_memory(model, _PlannerLikePlan(6) if plan == "planner" else plan)
        out, stats, grads = _step_stats(model, ids)
        assert out.cache is None and stats[0] > 0
        for a, b in zip(grads, ref_grads):
            assert torch.equal(a, b), (plan, use_cache)
        runs[use_cache] = stats
        assert model.config.use_cache is use_cache
    assert runs[True] == runs[False]
    # An explicit use_cache=True in a training forward is turned off too, warned once.
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="hyper_parallel: use_cache=True passed to a forward with grad on"):
        out, stats, grads = _step_stats(model, ids, use_cache=True)
    assert out.cache is None and stats == runs[False]
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # Eval and no-grad forwards keep the cache.
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).cache is None  # this config says no cache
        assert model(input_ids=ids, use_cache=True).cache.get_seq_length() == 12


def test_use_cache_passed_positionally_is_turned_off(host_swap):
    model = tiny_llama(2)
    apply_activation_memory(model, "swap")
    ids = torch.randint(0, VOCAB, (2, 8))
    # LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, cache,
    # inputs_embeds, labels, use_cache)
    with pytest.warns(UserWarning, match="hyper_parallel: use_cache=True passed"):
        out = model(ids, None, None, None, None, ids, True)
    assert out.cache is None


def test_save_pretrained_writes_the_config_as_it_was(tmp_path):
    import json

    model = tiny_llama(2)
    assert model.config.use_cache is True
    model.save_pretrained(tmp_path / "before")
    before = model.config.to_dict()
    apply_activation_memory(model, "checkpoint")
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    model.save_pretrained(tmp_path / "after")
    saved = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("before", "after")]
    assert saved[0] == saved[1] and saved[1]["use_cache"] is True
    assert remove_activation_memory(model)
    assert model.config.to_dict() == before


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")
@pytest.mark.parametrize("plan", ["swap", "checkpoint"])
def test_hf_gradient_checkpointing_enabled_after_apply_is_refused(plan, host_swap):
    # Enabled after the plan, transformers checkpointed the layers inside hyper_parallel's
    # wrappers: a swap plan silently became recompute. The next training forward refuses,
    # as apply does when it is on before (before anything runs: no state is touched).
    ref = tiny_llama(3, use_cache=False)
    model = copy.deepcopy(ref)
    apply_activation_memory(model, plan)
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, VOCAB, (2, 8))
    SwapManager().reset_stats()
    with pytest.raises(ValueError, match=r"^hyper_parallel: Hugging Face gradient checkpointing "
                       r"was turned on in LlamaForCausalLM .* after apply_activation_memory.*"
                       r"model.gradient_checkpointing_disable\(\)"):
        model(input_ids=ids, labels=ids)
    assert SwapManager().stats()["offload_count"] == 0
    with torch.no_grad():  # no backward, nothing recomputed: allowed
        model(input_ids=ids)
    model.gradient_checkpointing_disable()
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("plan", ["checkpoint", "selective", "mixed", "checkpoint_swap"])
@pytest.mark.parametrize("by", ["past_key_values", "cache", "positional"])
def test_a_kv_cache_in_a_training_forward_of_a_recomputing_plan_is_refused(plan, by,
                                                                           host_swap):
    # A no-grad prefix forward, then a training forward that continues from its cache:
    # the recompute would append to the cache a second time (transformers crashed with a
    # shape error). Refused with what to do, before the cache is touched.
    model = tiny_llama(3)
    apply_activation_memory(model, plan)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :6], use_cache=True).cache
    tail = ids[:, 6:]
    with pytest.raises(ValueError, match=r"^hyper_parallel: a KV cache \((cache|past_key_values)"
                       r"=\) was passed to a forward with grad on of LlamaForCausalLM under a "
                       r"plan that recomputes layers.*Pass no cache to forwards you "
                       r"differentiate"):
        if by == "positional":
            model(tail, None, None, prefix, None, tail)
        else:
            model(input_ids=tail, labels=tail, **{by: prefix})
    assert prefix.get_seq_length() == 6


def test_a_kv_cache_in_a_training_forward_of_a_swap_plan_trains(host_swap):
    # Without recompute the cache is read and extended once: gradients are bitwise those
    # of the plain model continuing from the same prefix.
    ref = tiny_llama(3)
    model = copy.deepcopy(ref)
    apply_activation_memory(model, "swap")
    ids = torch.randint(0, VOCAB, (2, 10))
    grads = []
    for m in (ref, model):
        with torch.no_grad():
            prefix = m(input_ids=ids[:, :6], use_cache=True).cache
        m(input_ids=ids[:, 6:], labels=ids[:, 6:], cache=prefix).loss.backward()
        assert prefix.get_seq_length() == 10
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                                   num_layers=2, num_decoder_layers=2, num_heads=2,
                                   decoder_start_token_id=0, dropout_rate=0.1)
    return transformers.T5ForConditionalGeneration(config)


@pytest.mark.parametrize("plan", ["checkpoint", "swap", "selective", "selective_swap"])
def test_t5_trains_bitwise(plan, host_swap):
    """T5's attention writes its scores in place (`scores += position_bias`) right after
    torch.matmul, whose bmm output selective checkpoint caches and which matmul returns
    through aten::_unsafe_view (its own version counter): the cached scores were stale
    and "selective" trained with silently wrong gradients (a fresh-user tester; max error
    0.02). The write is now seen through the storage, and bmm recomputed with it."""
    torch.manual_seed(0)
    base = t5().train()
    data = batches()[:2]
    # without a KV cache in both runs (use_cache=False per call: with the cache the
    # decoder's attention reads through its concatenation, and even a plain swap plan then
    # differs from the plain model in the last bits)
    ref_losses, ref_grads = train(copy.deepcopy(base), data, use_cache=False)
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "modified in place ...": once per op, expected
        apply_activation_memory(model, plan)
        losses, grads = train(model, data, use_cache=False)
    for step in range(len(data)):
        assert torch.equal(losses[step], ref_losses[step]), (plan, step)
        for a, b in zip(grads[step], ref_grads[step]):
            assert torch.equal(a, b), (plan, step, (a - b).abs().max())


@pytest.mark.parametrize("policy", ["save_all", "save_casts"])
def test_micro_batches_in_one_autocast_block_with_a_cast_caching_policy(policy):
    """Two micro-batches' forwards in one autocast block, one backward (a tester): the
    second forward takes every weight cast from autocast's cache while its recompute runs
    them, and a policy that caches `_to_copy` handed the recompute's weight casts the
    cached outputs of other casts (an unrelated 3-D tensor as a weight; where shapes
    matched, silently wrong gradients)."""
    policies = {"save_all": {"*": CheckpointPolicy.MUST_SAVE},
                "save_casts": [torch.ops.aten._to_copy.default]}

    def step(model):
        torch.manual_seed(1)
        data = [torch.randint(0, VOCAB, (2, 12)) for _ in range(2)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sum(model(input_ids=ids, labels=ids, use_cache=False).loss for ids in data)
        loss.backward()
        return [p.grad for p in model.parameters()]

    ref = step(tiny_llama(layers=2))
    model = tiny_llama(layers=2)
    apply_activation_memory(model, "selective", policy_fn=policies[policy])
    got = step(model)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


# Architectures beyond the decoder-only LMs above: an encoder (BERT), a vision
# transformer (pixel inputs), ALiBi attention (BLOOM), Falcon's parallel attention and
# MLP, an audio encoder-decoder (Whisper: two stacks, input features). Tiny configs, one
# step each, every plan bitwise against the plain model (dropout on: the RNG replays).
def _other(name):
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=32)), "text"
    if name == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            image_size=16, patch_size=4, num_labels=3)), "image"
    if name == "bloom":
        return transformers.BloomForCausalLM(transformers.BloomConfig(
            hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB)), "text"
    if name == "falcon":
        return transformers.FalconForCausalLM(transformers.FalconConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB)), "text"
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
        num_mel_bins=8, max_source_positions=16, max_target_positions=16,
        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)), "audio"


def _other_step(model, kind):
    torch.manual_seed(1)
    if kind == "image":
        out = model(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.tensor([0, 2]))
    elif kind == "audio":
        out = model(input_features=torch.randn(2, 8, 32),
                    labels=torch.randint(3, VOCAB, (2, 6)))
    else:
        ids = torch.randint(0, VOCAB, (2, SEQ))
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["bert", "vit", "bloom", "falcon", "whisper"])
def test_other_architectures_train_bitwise_under_every_plan(name, host_swap):
    torch.manual_seed(0)
    base, kind = _other(name)
    base.train()
    assert len(find_layers(base)) == (4 if name == "whisper" else 2)
    ref_loss, ref_grads = _other_step(copy.deepcopy(base), kind)
    for plan in ("checkpoint", "selective", "swap", "mixed", "selective_swap",
                 "checkpoint_swap"):
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "modified in place": once per op
            apply_activation_memory(model, plan)
            loss, grads = _other_step(model, kind)
        assert torch.equal(loss, ref_loss), (name, plan)
        for a, b in zip(grads, ref_grads, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (name, plan)
