"""The `Verifier` gRPC service over a `VerifierEngine`, and the Ray actor that hosts a replica.

One bidirectional `Verify` stream per session carries its rounds in order; every request gets
exactly one result. Bad input (unknown session, epoch ahead of the verifier, malformed proposal)
aborts that stream with INVALID_ARGUMENT; the server keeps serving every other stream. A call
without the cluster secret is refused with UNAUTHENTICATED (`cluster.wire.transport`).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures

import grpc

from cluster.core.config import NetworkConfig
from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import MAX_LOGPROBS
from cluster.model.verifier import VerifierEngine
from cluster.wire.codec import features_to_pb, logprobs_to_pb, params_from_pb, result_to_pb, round_from_pb
from cluster.wire.transport import LOOPBACK, SecretCheck, add_port, cluster_secret
from protos import pb, rpc

log = logging.getLogger(__name__)


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
            params = params_from_pb(request.params)
            if request.HasField("prompt_logprobs"):
                if request.prompt_logprobs > MAX_LOGPROBS:
                    raise InvalidRequestError(f"prompt_logprobs: at most {MAX_LOGPROBS}")
                params = params.model_copy(update={"prompt_logprobs": request.prompt_logprobs})
            opened = self.engine.open(request.session, list(request.token_ids), params, features=request.features)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        reply = pb.OpenReply(session=request.session, length=opened.length,
                             prompt_logprobs=logprobs_to_pb(opened.prompt_logprobs or ()))
        if opened.features is not None:
            reply.features.CopyFrom(features_to_pb(0, opened.features))
        return reply

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
                    self.engine.submit(round_from_pb(request, self.engine.runner.vocab_size), results.put)
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

    Every call must carry the cluster secret (`cluster.wire.transport`; read from Ray when not given);
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
