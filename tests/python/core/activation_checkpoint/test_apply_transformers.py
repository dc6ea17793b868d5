"""apply_activation_memory on transformers models (small random configs, CPU).

Five architectures: Llama, Qwen2, GPT-2 (dropout on, blocks in ``transformer.h``),
Mistral with its default flags (``use_cache`` on, a sliding window shorter than the
sequence) and Mixtral (mixture of experts). For each: ``find_layers`` names the decoder
blocks; every strategy trains 3 steps with losses and gradients bitwise equal to the
plain model; ``remove_activation_memory`` gives back the original modules. Sizes are
tiny (hidden 16, 3 layers, 12 tokens) so the whole file runs in seconds.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hyper_parallel.core.activation_checkpoint import (  # noqa: E402
    STRATEGIES,
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


def train(model, batches, seed: int = 0):
    """Three SGD steps; (losses, gradients of every step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step, tokens in enumerate(batches):
        torch.manual_seed(seed + step)  # dropout draws the same numbers in both runs
        out = model(input_ids=tokens, labels=tokens)
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
    # Recompute plans turn use_cache off, swap keeps it: each is compared with the plain
    # model under the same setting (with the cache on, attention reads keys and values
    # through the cache's concatenation, which can change the last bits).
    refs = {}
    for use_cache in {built[arch].config.use_cache, False}:
        plain = copy.deepcopy(built[arch])
        plain.config.use_cache = use_cache
        refs[use_cache] = train(plain, data)
    keys = list(built[arch].state_dict())
    for plan in PLANS:
        ref_losses, ref_grads = refs[False if STRATEGIES[plan].recomputes
                                     else built[arch].config.use_cache]
        model = copy.deepcopy(built[arch])
        originals = [model.get_submodule(n) for n in find_layers(model)]
        SwapManager().reset_stats()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "hyper_parallel: turned config.use_cache off")
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
        if STRATEGIES[plan].recomputes:
            assert model.config.use_cache == built[arch].config.use_cache  # restored


def test_use_cache_turned_off_with_one_warning(built):
    model = copy.deepcopy(built["mistral"])
    assert model.config.use_cache is True
    with pytest.warns(UserWarning, match="turned config.use_cache off on MistralForCausalLM"):
        report = apply_activation_memory(model, "checkpoint")
    assert model.config.use_cache is False and report.use_cache_disabled
    assert "use_cache turned off" in str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: applying again says nothing
        apply_activation_memory(model, "selective")
    assert model.config.use_cache is False
    # Swap alone recomputes nothing: the cache setting is left alone.
    apply_activation_memory(model, "swap")
    assert model.config.use_cache is True
    remove_activation_memory(model)
    assert model.config.use_cache is True


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
    with pytest.warns(UserWarning, match="hyper_parallel: use_cache=True passed to a training"):
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
