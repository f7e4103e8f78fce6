"""Skeleton-of-Thought's two stages as internal requests of the engine (`serve/sot.py` renders them): the engine's
`SotStages` part. Stage 1 (the skeleton) takes the client request's place in the queue; when it ends, stage 2
(the expansions, or a plain answer with a note) is queued ahead of everyone, its updates going to the client."""

from __future__ import annotations

import dataclasses

from pasta_jax.baselines.sot import SotConfig, skeleton_prompt_ids
from pasta_jax.decode import api
from pasta_jax.errors import PastaError
from pasta_jax.methods import Method, Sot
from pasta_jax.serve import sot
from pasta_jax.serve.requests import Request, Update


class SotStages:
  """The engine's staged requests (mixed into `Engine`: it reads the model, config, queue and lock)."""

  @property
  def sot_fan_out(self) -> int:
    return min(self.method_named(Sot.name).lanes, self.cfg.sot.max_points)

  @property
  def expand_method(self) -> Sot:
    """The method of SoT's expansion batch: the served `Sot`, its threads the fan-out."""
    return dataclasses.replace(self.method_named(Sot.name), max_threads=self.sot_fan_out)

  def _sot_config(self, request: Request) -> SotConfig:
    return dataclasses.replace(self.cfg.sot, chat=request.chat, point_tokens=request.max_tokens,
                               answer_tokens=request.max_tokens)

  def _stage(self, parent: Request, method: Method, ids: list[int], max_tokens: int, sink, **kw) -> Request:
    return Request(ids=ids, method=method, max_tokens=max_tokens, sink=sink, sampling=parent.sampling,
                   created=parent.created, id=parent.id, stage_of=parent, thread_progress=parent.thread_progress, **kw)

  def _skeleton_stage(self, parent: Request) -> Request:
    """Stage 1 in place of the client's request; when it ends, stage 2 is queued (`_after_skeleton`)."""
    config = self._sot_config(parent)
    ids = skeleton_prompt_ids(self.model.tokenizer, parent.question, config)
    return self._stage(parent, sot.PLAN, ids, config.skeleton_tokens, hidden=True,
                       sink=lambda update: self._after_skeleton(parent, config, update))

  def _expansion_too_big(self, ids: list[int], scripts, config: SotConfig) -> str:
    """Why an expansion cannot be served as SoT alone runs it (its rows hold less than the pool SoT gives it:
    the expansions would end sooner), or ""."""
    need = sot.expansion_slots(ids, scripts, config, self.expand_method.lanes)
    room = self.cfg.pool_slots * sot.EXPAND_POOL_FACTOR
    return f"the expansion needs {need} pool slots, the server's SoT rows hold {room}" if need > room else ""

  def _after_skeleton(self, parent: Request, config: SotConfig, update: Update) -> None:
    if not update.done:
      return
    if update.result is None:  # cut or failed: the client hears it as it is
      parent.sink(update)
      return
    end_id = self.model.tokenizer.tag_vocab().eos_ids[0]
    ids, scripts, expansion = sot.stage_two(self.model.tokenizer, parent.question, update.result.text, config,
                                            self.sot_fan_out, self.cfg.sot_script_tokens, end_id)
    if ids is not None:
      try:
        self.check(ids, 1)
      except PastaError as err:
        ids, expansion = None, f"the points' prompt does not fit: {err}"
    too_big = self._expansion_too_big(ids, scripts, config) if ids is not None else ""
    if too_big:
      ids, expansion = None, too_big
    if ids is None:  # no usable skeleton: answer plainly, and say why
      plain = api.prompt_ids(self.model.tokenizer, [parent.question], config.chat)[0]
      stage = self._stage(parent, sot.PLAN, plain, config.answer_tokens, _noting(parent.sink, expansion))
    else:
      render = lambda records, final: expansion.text(records, self.lang, self.model.tokenizer.tag_vocab(), final)
      stage = self._stage(parent, self.expand_method, ids, sot.expansion_budget(config, scripts), parent.sink,
                          scripts=scripts, render=render)
    with self.lock:  # a running request's next stage: ahead of the queue, and not counted against it
      self.waiting.appendleft(stage)


def _noting(sink, note: str):
  """`sink` with `note` added to the last update."""
  def noted(update: Update) -> None:
    sink(dataclasses.replace(update, note="; ".join(filter(None, [update.note, note]))) if update.done else update)
  return noted
