"""The `Verifier` gRPC service over a `VerifierEngine`, and the Ray actor that hosts a replica.

One bidirectional `Verify` stream per session carries its rounds in order; every request gets
exactly one result. Bad input (unknown session, epoch ahead of the verifier, malformed proposal)
aborts that stream with INVALID_ARGUMENT; the server keeps serving every other stream. A call
without the cluster secret is refused with UNAUTHENTICATED (`cluster.transport`).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures

import grpc
import torch

from cluster.errors import InvalidRequestError
from cluster.sampling import SamplingParams
from cluster.transport import LOOPBACK, NetworkConfig, SecretCheck, add_port, cluster_secret
from cluster.verifier import Round, RoundResult, VerifierEngine
from protos import pb, rpc

log = logging.getLogger(__name__)


def params_from_pb(msg) -> SamplingParams:
    return SamplingParams.build(
        max_tokens=max(1, msg.max_tokens), temperature=msg.temperature, top_p=msg.top_p or 1.0,
        top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None, stop=list(msg.stop),
        ignore_eos=msg.ignore_eos)


def params_to_pb(params: SamplingParams):
    return pb.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                             top_k=params.top_k, seed=params.seed, stop=params.stop, ignore_eos=params.ignore_eos)


def dense_draft_probs(proposal, vocab_size: int) -> torch.Tensor | None:
    """Sparse wire distributions -> q  # [k, vocab_size]; None for a deterministic proposer."""
    if not proposal.draft_probs:
        return None
    if len(proposal.draft_probs) != len(proposal.token_ids):
        raise InvalidRequestError(f"{len(proposal.token_ids)} drafts but {len(proposal.draft_probs)} draft distributions")
    q = torch.zeros(len(proposal.token_ids), vocab_size)
    for i, dist in enumerate(proposal.draft_probs):
        if len(dist.token_ids) != len(dist.probs) or any(t >= vocab_size for t in dist.token_ids):
            raise InvalidRequestError(f"draft distribution {i} is malformed")
        q[i, list(dist.token_ids)] = torch.tensor(list(dist.probs))
    if (q < 0).any() or ((q.sum(-1) - 1).abs() > 1e-3).any():
        raise InvalidRequestError("draft distributions must be non-negative and sum to 1")
    return q


def result_to_pb(r: RoundResult, active_sessions: int = 0):
    return pb.VerifyResult(session=r.session, round=r.round, epoch=r.epoch, num_accepted=r.num_accepted,
                           output_token_ids=r.output_token_ids, recovered=r.recovered, bonus=r.bonus,
                           stale=r.stale, verify_start=r.verify_start, verify_end=r.verify_end,
                           active_sessions=active_sessions)


_END = object()


class VerifierServicer(rpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, replica: str, tensor_parallel_size: int = 1):
        self.engine, self.replica, self.tp = engine, replica, tensor_parallel_size

    def _broken(self) -> str | None:
        return getattr(self.engine.runner, "broken", None)  # a tensor-parallel group that lost a rank

    def Open(self, request, context):
        if self._broken():
            context.abort(grpc.StatusCode.UNAVAILABLE, self._broken())
        try:
            length = self.engine.open(request.session, list(request.token_ids), params_from_pb(request.params))
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.OpenReply(session=request.session, length=length)

    def Release(self, request, context):
        return pb.ReleaseReply(released=self.engine.release(request.session))

    def Health(self, request, context):
        return pb.HealthReply(serving=not self._broken(), num_sessions=self.engine.num_sessions,
                              tensor_parallel_size=self.tp, replica=self.replica)

    def Verify(self, request_iterator, context):
        results: queue.SimpleQueue = queue.SimpleQueue()
        submitted = [0]

        def read() -> None:
            try:
                for request in request_iterator:
                    rnd = Round(request.session, request.round, request.epoch, list(request.proposal.token_ids),
                                dense_draft_probs(request.proposal, self.engine.runner.vocab_size), request.bonus)
                    self.engine.submit(rnd, results.put)
                    submitted[0] += 1
            except InvalidRequestError as e:
                results.put(e)
            except Exception as e:  # the client went away
                log.debug("verify stream ended: %s", e)
            results.put(_END)

        threading.Thread(target=read, daemon=True, name="verify-reader").start()
        delivered, ended = 0, False
        while not ended or delivered < submitted[0]:
            item = results.get()
            if item is _END:
                ended = True
                continue
            if isinstance(item, InvalidRequestError):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, Exception):
                context.abort(grpc.StatusCode.INTERNAL, f"verification failed: {item}")
            delivered += 1
            yield result_to_pb(item, self.engine.num_sessions)


def serve(engine: VerifierEngine, replica: str, host: str = LOOPBACK, port: int = 0,
          tensor_parallel_size: int = 1, max_workers: int = 128, network: NetworkConfig | None = None,
          secret: str | None = None) -> tuple[grpc.Server, int]:
    """Start the gRPC server and the engine thread; returns (server, bound port).

    Every call must carry the cluster secret (`cluster.transport`; read from Ray when not given);
    `network.tls` puts the service on TLS."""
    network = network or NetworkConfig()
    secret = secret if secret is not None else cluster_secret()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="verifier"),
                         interceptors=[SecretCheck(secret)])
    rpc.add_VerifierServicer_to_server(VerifierServicer(engine, replica, tensor_parallel_size), server)
    bound = add_port(server, host, port, network)
    server.start()
    threading.Thread(target=engine.run_forever, daemon=True, name="verifier-engine").start()
    return server, bound
