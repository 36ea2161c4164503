"""`trtspec serve --ray`: the same OpenAI app on Ray Serve, N engine replicas behind one endpoint.

Two deployments (the layout Ray Serve's own LLM stack uses, for the same reason: the HTTP proxy
cannot see a request body, a deployment handle can):

- ``EngineReplica`` (N replicas, ``num_cpus`` = its threads, ``num_gpus`` where engines run on a GPU):
  owns one Scheduler and its engines; ``generate`` streams one request's events. It exports its
  scheduler's counters as Ray metrics (tagged with the replica) and reports unhealthy once its
  engine has failed, so Ray replaces it.
- ``OpenAIIngress`` (light, ``num_cpus=0``): app.create_app over a RemoteScheduler — tokenising,
  validation and OpenAI's JSON happen here, generation on the replica the router picks.

Routing: PrefixAwareRouter sends a prompt to the replica that was sent its longest prefix (its
prefix cache likely holds the KV), unless that replica is busier than the least loaded by more than
``imbalance`` requests; otherwise Ray's power-of-two-choices. ``build_app`` is also the import path
of a Serve config file (``serve run`` / ``serve deploy``; see docs/serving.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict

try:
    import ray
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
    from ray.serve.request_router import RequestRouter  # noqa: F401 - the public router API this module builds on
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "trtspec's Ray Serve front needs Ray Serve, an optional extra: pip install 'trtspec[ray]' "
        f"(or pip install 'ray[serve]==2.60.*'); import failed with: {exc}"
    ) from exc
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from ..runtime.request import GenerationResult, InvalidRequestError, RequestFailedError, RequestStats
from ..runtime.scheduler import Scheduler
from ..runtime.tokenizer import encode_prompt
from .app import create_app
from .protocol import APIError
from .routing import PrefixIndex

log = logging.getLogger("trtspec.server")

ROUTERS = ("prefix", "pow2")
_APP_OPTIONS = ("api_key", "log_prompts", "max_body_bytes", "metrics_public", "parse_special_tokens")
_SCHEDULER_OPTIONS = ("drafter", "num_draft_tokens", "k_policy", "max_batch", "prefill_chunk", "prefix_cache_mb",
                      "min_prefix_tokens", "sampling", "num_threads", "tree_width", "tree_nodes", "datastore")


# -- the engine replica ------------------------------------------------------------------------------------------


class EngineReplica:
    """One Scheduler and its engines in one Ray actor. ``scheduler_options`` as runtime.Scheduler's."""

    def __init__(self, target: str, draft: str | None = None, scheduler_options: dict | None = None,
                 system_prompts: tuple = (), metrics_period_s: float = 1.0):
        self.scheduler = Scheduler(target, draft, **(scheduler_options or {}))
        s = self.scheduler
        for text in system_prompts:
            s.register_prefix(text)
        s.submit([s.bos_id if s.bos_id is not None else 0], max_new_tokens=2).result()  # first-call costs paid here
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - constructed outside Serve (tests)
            self.replica = f"local-{os.getpid()}"
        self._metrics = _ReplicaMetrics(s) if _in_serve() else None
        if self._metrics is not None:
            threading.Thread(target=self._metrics.run, args=(metrics_period_s,), daemon=True,
                             name="trtspec-replica-metrics").start()

    def info(self) -> dict:
        """What the ingress needs to tokenise and validate without engines: limits and the tokenizer itself."""
        s = self.scheduler
        return {"capacity": s.capacity, "max_batch": s.max_batch, "drafter": s.drafter_name, "bos_id": s.bos_id,
                "vocab_size": s.target.vocab_size, "tokenizer": s.tokenizer}

    async def generate(self, ids: list, params: dict):
        """Stream one request: ("delta", text)..., then ("done", result dict with the last text) or ("error", message).

        Invalid parameters give one ("invalid", message) event (the ingress answers 400; nothing is logged
        as a replica error), and so does a request that fails alone because it cannot be honoured (its grammar
        failed while decoding). If the caller goes away (Ray cancels this generator), the request is cancelled
        and its row freed within one round."""
        try:
            handle = self.scheduler.submit_async(ids, **params)
        except (ValueError, TypeError) as exc:
            yield ("invalid", str(exc))
            return
        last = ""
        try:
            async for delta in handle:
                if handle.result is not None:  # the last piece travels with the result: one stream item less
                    last = delta
                    break
                yield ("delta", delta)
        except InvalidRequestError as exc:
            yield ("invalid", str(exc))
            return
        except RequestFailedError as exc:
            yield ("error", f"{exc} (replica {self.replica})")
            return
        r = handle.result
        yield ("done", {"text": r.text, "token_ids": list(r.token_ids), "finish_reason": r.finish_reason,
                        "stats": asdict(r.stats), "replica": self.replica, "pid": os.getpid(), "delta": last,
                        "logprobs": r.logprobs, "prompt_logprobs": r.prompt_logprobs})

    def stats(self) -> dict:
        return {**asdict(self.scheduler.stats()), "replica": self.replica, "pid": os.getpid()}

    def check_health(self):
        """Ray calls this periodically; raising marks the replica unhealthy and Ray replaces it."""
        failure = self.scheduler.failure
        if failure is not None:
            raise RuntimeError(f"the engine failed ({type(failure).__name__}: {failure}); this replica needs replacing")


def _in_serve() -> bool:
    try:
        serve.get_replica_context()
        return True
    except Exception:  # noqa: BLE001
        return False


class _ReplicaMetrics:
    """The scheduler's counters as Ray metrics (Serve adds deployment/replica/application tags), so each
    replica shows on Ray's Prometheus endpoint next to Ray Serve's own metrics."""

    _GAUGES = {"running": "Requests in engine rows", "waiting": "Requests waiting for an engine row",
               "prefix_cache_bytes": "KV bytes held by the prefix cache"}
    _COUNTERS = {"rounds": "Scheduler rounds (verify calls)", "generated_tokens": "Tokens generated",
                 "prompt_tokens": "Prompt tokens read", "proposed": "Draft tokens proposed",
                 "accepted": "Draft tokens accepted", "prefix_hits": "Admissions that reused cached prefix slots",
                 "prefix_misses": "Admissions that found no cached prefix",
                 "prefix_tokens_reused": "Prompt tokens not recomputed thanks to the prefix cache",
                 "requests_finished": "Requests finished", "requests_failed": "Requests failed (an engine error, or their own)"}

    def __init__(self, scheduler):
        from ray.serve.metrics import Counter, Gauge

        self.scheduler = scheduler
        self.gauges = {k: Gauge(f"trtspec_replica_{k}", description=d) for k, d in self._GAUGES.items()}
        self.counters = {k: Counter(f"trtspec_replica_{k}", description=d) for k, d in self._COUNTERS.items()}
        self.last = dict.fromkeys(self._COUNTERS, 0)

    def update(self):
        s = asdict(self.scheduler.stats())
        for k, g in self.gauges.items():
            g.set(s[k])
        for k, c in self.counters.items():
            if s[k] > self.last[k]:
                c.inc(s[k] - self.last[k])
                self.last[k] = s[k]

    def run(self, period_s):
        while True:
            try:
                self.update()
            except Exception:  # noqa: BLE001 - metrics never take the replica down
                log.exception("updating replica metrics failed")
            time.sleep(period_s)


# -- the ingress side -------------------------------------------------------------------------------------------


class RemoteRequestHandle:
    """AsyncRequestHandle's interface over a streaming call to an engine replica."""

    def __init__(self, stream):
        self._stream = stream
        self._first = None
        self._failure: BaseException | None = None  # fail()'s error, raised instead of the cancelled stream's
        self.result: GenerationResult | None = None

    async def start(self):
        """Wait until a replica has taken the request and sent its first event (errors surface here as
        ValueError: bad parameters, APIError 429/503: no room, RequestFailedError: the replica failed)."""
        self._first = await self._receive()
        if self._first[0] == "invalid":
            raise ValueError(self._first[1])

    async def _next(self):
        try:
            return await self._stream.__anext__()
        except Exception:
            if self._failure is not None:
                raise self._failure from None
            raise

    async def _receive(self):
        try:
            return await self._next()
        except StopAsyncIteration:
            return ("error", "the engine replica ended the stream without a result")
        except BackPressureError:
            raise APIError(429, "every engine replica's queue is full; retry shortly", type="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except DeploymentUnavailableError as exc:
            raise APIError(503, f"no engine replica is available ({exc}); retry later", type="service_unavailable",
                           headers={"Retry-After": "1"}) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise RequestFailedError(f"the engine replica serving this request died ({type(exc).__name__}); "
                                     "retry: Ray routes new requests to healthy replicas") from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (ValueError, TypeError)):
                raise type(cause)(str(cause)) from None
            raise RequestFailedError(f"the engine replica raised {type(cause or exc).__name__}: {cause or exc}") from None

    async def __aiter__(self):
        try:
            event, self._first = self._first, None
            while True:
                kind, value = event if event is not None else await self._receive()
                event = None
                if kind == "delta":
                    if value:
                        yield value
                elif kind == "done":
                    if value["delta"]:
                        yield value["delta"]
                    stats = RequestStats(**value["stats"])
                    self.result = GenerationResult(value["text"], value["token_ids"], value["finish_reason"], stats,
                                                   replica=value["replica"], logprobs=value.get("logprobs"),
                                                   prompt_logprobs=value.get("prompt_logprobs"))
                    return
                elif kind == "invalid":  # it failed alone, and cannot be honoured: a 400 (InvalidRequestError)
                    raise InvalidRequestError(value)
                else:
                    raise RequestFailedError(value)
        finally:
            if self.result is None:
                self.cancel()  # the consumer went away (or the replica failed): stop the replica's work

    def cancel(self):
        self._stream.cancel()

    def fail(self, error: BaseException):
        """End this handle with ``error`` (its consumer raises it) and cancel the replica's work."""
        self._failure = error
        self.cancel()


class RemoteScheduler:
    """The part of Scheduler's front that app.create_app uses, over a handle to EngineReplica."""

    def __init__(self, engine_handle):
        self._handle = engine_handle
        self._streaming = engine_handle.options(stream=True)

    def backlog(self, arriving: int = 0) -> int:
        """0: requests queue in Ray's routers and the replicas, where max_queued_requests bounds them (a
        BackPressureError, the 429)."""
        return 0

    async def connect(self):
        info = await self._handle.info.remote()
        self.capacity, self.max_batch = info["capacity"], info["max_batch"]
        self.drafter_name, self.bos_id, self.vocab_size = info["drafter"], info["bos_id"], info["vocab_size"]
        self.tokenizer = info["tokenizer"]

    def encode(self, prompt):
        return encode_prompt(self.tokenizer, prompt, vocab_size=self.vocab_size, bos_id=self.bos_id,
                             capacity=self.capacity)

    def submit_async(self, ids, **params) -> RemoteRequestHandle:
        return RemoteRequestHandle(self._streaming.generate.remote([int(t) for t in ids], params))

    async def asubmit(self, ids, n: int = 1, **params) -> list[RemoteRequestHandle]:
        """n samples of one prompt (sample i with seed + i), each routed on its own; validation happens on the
        replica that takes it (its ValueError comes back through ``start``)."""
        seed = params.pop("seed", None)
        return [self.submit_async(ids, seed=None if seed is None else seed + i, **params) for i in range(n)]

    def close(self, timeout=None):
        """Nothing to close here: the engine replicas belong to Ray."""


@serve.ingress()
class OpenAIIngress:
    """``app_options``: create_app's (``api_key``, ``log_prompts``, ``max_body_bytes``, ``metrics_public``,
    ``parse_special_tokens``)."""

    def __init__(self, engine_handle, model_name: str, app_options: dict | None = None):
        self._remote = RemoteScheduler(engine_handle)
        self._app_options = dict(model_name=model_name, warmup=False, **(app_options or {}))

    def __serve_build_asgi_app__(self):
        return create_app(self._remote, **self._app_options)


# -- prefix-aware routing ---------------------------------------------------------------------------------------


def _prompt_ids(pending_request):
    args = getattr(pending_request, "args", None)
    if args and isinstance(args[0], list):
        return args[0]
    return None


class PrefixAwareRouter(PowerOfTwoChoicesRequestRouter):
    """Prefer the replica that was sent the longest prefix of this prompt (at least ``min_match_tokens``),
    unless its queue exceeds the least loaded replica's by more than ``imbalance``. A prompt no replica
    has seen goes to the one holding the fewest prefix blocks among those within ``imbalance`` of the
    least loaded (so new prefixes spread evenly and stay put); prompts too short to match, and
    everything when loads are far apart, go by Ray's power of two choices."""

    def initialize_state(self, block_tokens: int = 16, min_match_tokens: int = 16, imbalance: int = 4):
        self._index = PrefixIndex(block_tokens)
        self._min_match = min_match_tokens
        self._imbalance = imbalance

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ids = _prompt_ids(pending_request)
        if ids is not None and len(ids) >= self._min_match and len(candidate_replicas) > 1:
            queue = self.replica_queue_len_cache
            load = {r.replica_id: queue.get(r.replica_id) or 0 for r in candidate_replicas}
            least = min(load.values())
            near = [r for r in candidate_replicas if load[r.replica_id] - least <= self._imbalance]
            matched = self._index.matched_tokens(ids, [r.replica_id for r in near])
            best = max(near, key=lambda r: matched[r.replica_id])
            if matched[best.replica_id] < self._min_match:  # a new prefix: to whoever holds the fewest
                best = min(near, key=lambda r: (self._index.held_blocks(r.replica_id), load[r.replica_id]))
            return [[best], [r for r in candidate_replicas if r is not best]]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result):
        super().on_request_routed(pending_request, replica_id, result)
        ids = _prompt_ids(pending_request)
        if ids is not None:
            self._index.record(ids, replica_id)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id)

    def update_replicas(self, replicas):
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        result = super().update_replicas(replicas)
        for replica_id in gone:
            self._index.forget(replica_id)
        return result


# -- the application --------------------------------------------------------------------------------------------


def build_app(args: dict):
    """The Serve application (also the ``import_path`` of a Serve config: ``trtspec.server.ray_app:build_app``).

    ``args``: ``target`` (required), ``draft``, the Scheduler options (``drafter``, ``num_draft_tokens``,
    ``k_policy``, ``max_batch``, ``prefill_chunk``, ``prefix_cache_mb``, ``min_prefix_tokens``, ``sampling``,
    ``num_threads``: threads per replica, default 1; ``datastore``: an index every replica maps), ``replicas`` (default 1) or ``autoscale``
    (``{"min_replicas", "max_replicas", "target_ongoing_requests"}``), ``router`` ("prefix" | "pow2"),
    ``max_queue`` (requests queued beyond the replicas' rows before 429), ``gpus_per_replica``,
    ``system_prompts``, ``model_name``, ``health_check_period_s``, and the ingress's create_app options
    ``api_key`` (a key or a list of keys), ``log_prompts``, ``max_body_bytes``, ``metrics_public``,
    ``parse_special_tokens``.
    Paths are resolved here; in a config file for a cluster give absolute paths present on every node.
    """
    args = dict(args)
    known = {"target", "draft", "replicas", "autoscale", "router", "max_queue", "gpus_per_replica", "system_prompts",
             "model_name", "health_check_period_s", *_APP_OPTIONS, *_SCHEDULER_OPTIONS}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown trtspec Ray Serve argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if not args.get("target"):
        raise ValueError("the target engine directory is required: target=PATH")
    target = os.path.abspath(args["target"])
    draft = os.path.abspath(args["draft"]) if args.get("draft") else None
    for path in filter(None, (target, draft)):
        if not os.path.isdir(path):
            raise ValueError(f"engine directory {path} does not exist (on a cluster, every node needs it at this path)")
    options = {k: args[k] for k in _SCHEDULER_OPTIONS if args.get(k) is not None}
    options = {k: int(v) if k in ("num_draft_tokens", "max_batch", "prefill_chunk", "min_prefix_tokens",
                                  "num_threads", "tree_width", "tree_nodes") else v for k, v in options.items()}
    options.setdefault("num_threads", 1)
    threads = options["num_threads"]
    max_batch = options.get("max_batch") or _engine_rows(target, draft)
    router = args.get("router") or "prefix"
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
    engine_options = dict(
        name="EngineReplica",
        ray_actor_options={"num_cpus": threads, "num_gpus": float(args.get("gpus_per_replica") or 0)},
        max_ongoing_requests=2 * max_batch,  # a batch running, the next one queued in the scheduler
        health_check_period_s=float(args.get("health_check_period_s") or 2.0),
        health_check_timeout_s=30.0,
    )
    if args.get("max_queue") is not None:
        engine_options["max_queued_requests"] = int(args["max_queue"])
    if router == "prefix":
        engine_options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAwareRouter)
    autoscale = args.get("autoscale")
    if autoscale:
        autoscale = {"target_ongoing_requests": max_batch, **autoscale}
        engine_options["autoscaling_config"] = AutoscalingConfig(**autoscale)
    else:
        replicas = int(args.get("replicas") or 1)
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        engine_options["num_replicas"] = replicas
    engine = serve.deployment(EngineReplica).options(**engine_options).bind(
        target, draft, options, tuple(args.get("system_prompts") or ()))
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    model_name = args.get("model_name") or os.path.basename(target.rstrip("/"))
    return ingress.bind(engine, model_name, {k: args[k] for k in _APP_OPTIONS if args.get(k) is not None})


def _engine_rows(target, draft) -> int:
    from ..manifest import read_manifest

    return min(read_manifest(p, verify=False)["model"]["max_batch"] for p in filter(None, (target, draft)))
