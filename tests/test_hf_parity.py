"""Our Flax Gemma against Hugging Face transformers, through our own loaders.

1. Tiny random Gemma 1/2/3 models built with transformers' config classes, saved with
   save_pretrained, loaded by `load_model`: prefill logits agree with HF (eager, float32).
2. Decoding step by step through an interleaved KVPool equals the full forward at every position.
3. (slow) The real Gemma 3 270M GGUF loaded by us and by transformers: same greedy continuations,
   close logits.
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pasta_jax.model import gguf_loader  # noqa: E402
from pasta_jax.model.gemma import Gemma, KVPool, causal_mask  # noqa: E402
from pasta_jax.model.load import embedded_gguf_path, load_model  # noqa: E402
from pasta_jax.model.weights import config_to_hf, save_hf  # noqa: E402

TINY_LOGIT_TOL = 1e-4
SEQ_LEN = 20
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)


def _hf_configs():
  """One tiny config per family; each exercises what its family adds."""
  return {
      # MQA, non-default RoPE base
      "gemma1": transformers.GemmaConfig(**_COMMON, num_hidden_layers=2, num_key_value_heads=1,
                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
      # GQA, window 4 (matters at length 20), query_pre_attn_scalar != head_dim, caps that bite
      "gemma2": transformers.Gemma2Config(**_COMMON, num_hidden_layers=3, num_key_value_heads=2,
                                          sliding_window=4, query_pre_attn_scalar=24,
                                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
      # QK-norm, explicit (non-periodic) layer types, per-kind RoPE bases, linear scaling on global
      "gemma3": transformers.Gemma3TextConfig(
          **_COMMON, num_hidden_layers=4, num_key_value_heads=2, sliding_window=6, query_pre_attn_scalar=32,
          layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2000.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
  }


def _randomize(model, seed: int) -> None:
  """HF inits norms to 0 and weights at 0.02: too gentle to catch a layout bug. Make everything bite."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      std = 0.3 if "norm" in name else 0.15
      p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """family -> (HF model, our LoadedModel, folder); each saved by HF and loaded by us."""
  out = {}
  for i, (family, hf_config) in enumerate(_hf_configs().items()):
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    _randomize(model, seed=i)
    model.eval()
    folder = tmp_path_factory.mktemp(f"hf-{family}")
    # Gemma 2 is written sharded, in transformers' own index format
    model.save_pretrained(folder, max_shard_size="100KB" if family == "gemma2" else "1GB")
    assert (folder / "model.safetensors.index.json").exists() == (family == "gemma2")
    out[family] = (model, load_model(str(folder)), folder)
  return out


def _tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 512, (batch, length)).astype(np.int32)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


@functools.cache
def _forward(config):
  """Full causal forward, compiled once per config (compiles dominate these tests' time)."""
  model = Gemma(config)

  def run(params, tokens):
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length), (b, length))
    return model.apply(params, tokens, positions, causal_mask(b, length)).logits

  return jax.jit(run)


@pytest.mark.parametrize("family", ["gemma1", "gemma2", "gemma3"])
def test_prefill_logits_match_hf(tiny, family):
  hf_model, loaded, _ = tiny[family]
  assert loaded.config.family == family
  tokens = _tokens(2, SEQ_LEN, seed=1)
  ours = np.asarray(_forward(loaded.config)(loaded.params, tokens))
  theirs = _hf_logits(hf_model, tokens)
  diff = np.abs(ours - theirs).max()
  print(f"{family}: max |logit diff| = {diff:.2e} (logit scale {np.abs(theirs).max():.1f})")
  assert diff < TINY_LOGIT_TOL


def test_sliding_window_and_caps_matter(tiny):
  """Guards the parity test: with the window or the caps dropped, the logits must differ."""
  import dataclasses
  for family, change in [("gemma2", dict(sliding_window=10_000)), ("gemma2", dict(attn_logit_softcap=None)),
                         ("gemma3", dict(rope_scale_global=1.0))]:
    _, loaded, _ = tiny[family]
    tokens = _tokens(1, SEQ_LEN, seed=2)
    base = np.asarray(_forward(loaded.config)(loaded.params, tokens))
    other = np.asarray(_forward(dataclasses.replace(loaded.config, **change))(loaded.params, tokens))
    assert np.abs(base - other).max() > 100 * TINY_LOGIT_TOL, (family, change)


def test_exported_folder_loads_in_transformers(tiny, tmp_path):
  """`save_hf` writes a folder transformers reads back to the same model (config and tensors)."""
  hf_model, loaded, _ = tiny["gemma3"]
  save_hf(tmp_path, loaded.params, loaded.config)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                               dtype=torch.float32)
  assert reloaded.config.model_type == config_to_hf(loaded.config)["model_type"]
  tokens = _tokens(1, SEQ_LEN, seed=3)
  np.testing.assert_allclose(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens), atol=1e-6)


# --- (2) decoding through a KV pool -----------------------------------------------------------------

@functools.cache
def _pool_step(config):
  model = Gemma(config)

  def step(params, pool, tokens, positions, mask, slots, kv_positions):  # -> (logits, pool written)
    out = model.apply(params, tokens, positions, mask, pool=pool, slots=slots, kv_positions=kv_positions)
    return out.logits, out.kv

  return jax.jit(step)


@pytest.mark.parametrize("family,prefill", [("gemma1", 0), ("gemma2", 0), ("gemma3", 0), ("gemma3", 6)])
def test_pool_decode_equals_full_forward(tiny, family, prefill):
  """Optionally prefill some tokens at once, then one token per step, into shuffled pool slots
  (per-row, non-contiguous, spare slots never written): every position's logits equal the full
  forward's. Window layers see keys only through kv_positions, so the shuffle tests those too."""
  _, loaded, _ = tiny[family]
  config, params = loaded.config, loaded.params
  batch, spare = 2, 5
  num_slots = SEQ_LEN + spare
  tokens = _tokens(batch, SEQ_LEN, seed=4)
  full = np.asarray(_forward(config)(params, tokens))
  rng = np.random.default_rng(5)
  slot_of = np.stack([rng.permutation(num_slots)[:SEQ_LEN] for _ in range(batch)])  # [B, L]
  kv_positions = np.zeros((batch, num_slots), np.int32)
  np.put_along_axis(kv_positions, slot_of, np.arange(SEQ_LEN)[None].repeat(batch, 0), axis=1)
  step = _pool_step(config)
  pool = KVPool.zeros(config, batch, num_slots)

  def run(start, stop, pool):
    positions = np.arange(start, stop)[None].repeat(batch, 0).astype(np.int32)
    visible = np.zeros((batch, stop - start, num_slots), bool)  # query at pos sees positions <= pos
    for b in range(batch):
      for q, pos in enumerate(range(start, stop)):
        visible[b, q, slot_of[b, : pos + 1]] = True
    logits, pool = step(params, pool, tokens[:, start:stop], positions, visible, slot_of[:, start:stop],
                        kv_positions)
    return np.asarray(logits), pool

  worst = 0.0
  if prefill:
    logits, pool = run(0, prefill, pool)
    worst = np.abs(logits - full[:, :prefill]).max()
  for t in range(prefill, SEQ_LEN):
    logits, pool = run(t, t + 1, pool)
    worst = max(worst, np.abs(logits[:, 0] - full[:, t]).max())
  print(f"{family}: pool decode vs full forward max |diff| = {worst:.2e}")
  assert worst < 1e-5


# --- (3) the real Gemma 3 270M ----------------------------------------------------------------------

REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three tips for staying healthy are"]
REAL_NEW_TOKENS = 32
REAL_LOGIT_TOL = 2e-3  # measured ~8e-5 on logits of magnitude ~30 (float32 summation order only)
# google/gemma-3-270m's config.json, for the fields the GGUF lacks (layer pattern, local RoPE base)
GEMMA3_270M = dict(vocab_size=262_144, embed_dim=640, hidden_dim=2048, num_layers=18, num_heads=4,
                   num_kv_heads=1, head_dim=256, query_pre_attn_scalar=256.0, sliding_window=512,
                   rope_base_global=1_000_000.0, rope_base_local=10_000.0, rope_scale_global=1.0,
                   attn_logit_softcap=None, final_logit_softcap=None,
                   layer_kinds=(("local",) * 5 + ("global",)) * 3)


def _load_transformers_270m(path, config):
  hf_config = transformers.Gemma3TextConfig(**{k: v for k, v in config_to_hf(config).items()
                                               if k != "model_type"})
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, config=hf_config, dtype=torch.float32,
      attn_implementation="eager")
  return model.eval()


@pytest.fixture(scope="module")
def real():
  """Gemma 3 270M from the embedded GGUF, loaded by us (with its tokenizer) and by transformers.

  transformers gets our config (checked against the official one in the test) instead of parsing
  the file a second time: that parse alone takes ~15 s. The weights come from its own GGUF loading,
  which runs in a thread (mostly Python, ~20 s) while our side loads and decodes: (ours, future).
  """
  path = embedded_gguf_path()
  config = gguf_loader.config_from_gguf(gguf_loader.read_gguf(path))
  executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  theirs = executor.submit(_load_transformers_270m, path, config)
  yield load_model("base"), theirs
  executor.shutdown(wait=True)


def _greedy_ours(loaded, prompts: list[list[int]],
                 new_tokens: int) -> tuple[list[list[int]], list[np.ndarray]]:
  """Greedy decoding of a batch of prompts of different lengths, one token per step through a pool.

  Every row steps through positions 0, 1, ...: inside its prompt a row is fed the prompt (teacher
  forcing), after it its own argmax. One compiled step serves the whole run. Returns the
  continuations and, per row, the logits at every position but the last [len - 1, V].
  """
  config, params = loaded.config, loaded.params
  batch = len(prompts)
  total = max(map(len, prompts)) + new_tokens
  step = _pool_step(config)
  pool = KVPool.zeros(config, batch, total)
  kv_positions = np.broadcast_to(np.arange(total, dtype=np.int32), (batch, total))
  seqs = [list(p) for p in prompts]
  logits_per_row: list[list[np.ndarray]] = [[] for _ in prompts]
  for t in range(total - 1):
    token = np.array([[s[min(t, len(s) - 1)]] for s in seqs], np.int32)
    mask = np.broadcast_to(np.arange(total) <= t, (batch, 1, total))
    positions = np.full((batch, 1), t, np.int32)
    logits, pool = step(params, pool, token, positions, mask, positions, kv_positions)
    logits = np.asarray(logits[:, 0])
    for b, s in enumerate(seqs):
      if len(s) == t + 1 and len(s) < len(prompts[b]) + new_tokens:
        logits_per_row[b].append(logits[b])
        s.append(int(logits[b].argmax()))
      elif t + 1 < len(s):
        logits_per_row[b].append(logits[b])
  return [s[len(p):] for s, p in zip(seqs, prompts)], [np.stack(rows) for rows in logits_per_row]


@pytest.mark.slow
def test_real_gemma3_270m_matches_transformers(real):
  """Same greedy continuations and close logits at every position.

  HF runs one teacher-forced forward over prompt + our continuation: its argmax at every position
  equal to our next token is exactly "HF's greedy decoding produces the same tokens", without the
  cost of HF's generate loop.
  """
  ours, future = real
  for field, value in GEMMA3_270M.items():
    assert getattr(ours.config, field) == value, field
  tok = ours.tokenizer
  prompts = [tok.encode(p) for p in REAL_PROMPTS]
  continuations, our_logits = _greedy_ours(ours, prompts, REAL_NEW_TOKENS)
  theirs = future.result()
  worst = 0.0
  for prompt, cont, mine in zip(prompts, continuations, our_logits):
    seq = prompt + cont
    assert len(cont) == REAL_NEW_TOKENS
    ref = _hf_logits(theirs, np.array([seq], np.int32))[0, :-1]  # [len - 1, V]: predicts seq[1:]
    hf_greedy = ref[len(prompt) - 1:].argmax(-1).tolist()
    assert hf_greedy == cont, f"greedy continuations differ after {tok.decode(prompt)!r}:\n" \
                              f"ours {tok.decode(cont)!r}\nHF   {tok.decode(hf_greedy)!r}"
    worst = max(worst, float(np.abs(mine - ref).max()))
  print(f"Gemma 3 270M: max |logit diff| vs transformers = {worst:.2e}; continuations: "
        + " | ".join(repr(tok.decode(c)) for c in continuations))
  assert worst < REAL_LOGIT_TOL


@pytest.mark.slow
def test_real_tokenizer(real):
  ours, _ = real
  tok = ours.tokenizer
  assert tok.bos_id == 2 and tok.eos_ids == (1, 106)
  text = "Hello world, ünïcode 😀"
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and tok.encode(text, add_bos=False) == ids[1:]
  assert tok.decode(ids[1:]) == text
  chat = tok.encode_chat("Hi")
  assert chat[:3] == [2, tok.token_to_id("<start_of_turn>"), tok.token_to_id("user")]
  assert tok.decode(chat, skip_special_tokens=False).endswith("<start_of_turn>model\n")
  assert tok.token_to_id("<definitely not a token>") is None
  tags = tok.tag_vocab()
  assert tags.promise == tok.token_to_id("<unused0>") and tags.eos_ids == (1, 106)
