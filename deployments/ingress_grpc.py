"""The public gRPC `Generation` service of the ingress (through Serve's gRPC proxy): `Generate` and the health
`Check`, as methods of the ingress replica (`deployments/ingress.py`'s `IngressRoutes` takes them from
`GrpcRoutes`). Where `api_keys` are set, `Generate` wants one in the metadata as HTTP wants it in the headers
(`authorization: Bearer KEY` or `x-api-key: KEY`), or answers UNAUTHENTICATED; the health `Check` is open, as
`/health` is. A bad request is INVALID_ARGUMENT, before a stream starts; an error after the start carries the
code of its kind (`ERROR_STATUS`)."""

import asyncio

import grpc

from cluster.core import grammar
from cluster.core.errors import InvalidRequestError
from cluster.wire.codec import (cache_salt_from_pb, logprob_fields_from_pb, logprobs_to_pb, prediction_from_pb,
                                processor_fields_from_pb, text_fields_from_pb)
from deployments.chunks import ErrorChunk, FinishChunk, PromptChunk, TokensChunk
from protos import UnreadableRequest, pb

# an ErrorChunk's type -> (HTTP status, gRPC code); anything else is a server error
ERROR_STATUS = {"invalid_request_error": (400, grpc.StatusCode.INVALID_ARGUMENT),
                "service_unavailable": (503, grpc.StatusCode.UNAVAILABLE),
                "overloaded": (503, grpc.StatusCode.RESOURCE_EXHAUSTED),
                "timeout": (504, grpc.StatusCode.DEADLINE_EXCEEDED)}

UNAUTHENTICATED = "invalid or missing API key (metadata authorization: Bearer ..., or x-api-key)"

# chat roles a gRPC ChatMessage may carry -> the role the chat template sees
GRPC_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class GrpcRoutes:
    """The gRPC methods; the ingress's checks and session stream (`_chat_ids`, `_sampling`, `_run`, ...) are
    `IngressRoutes`'."""

    async def Generate(self, request, grpc_context=None):
        metadata = dict(grpc_context.invocation_metadata())
        if not self._key_accepted(metadata.get("authorization", ""), metadata.get("x-api-key", "")):
            # the HTTP routes' 401: api_keys gate gRPC as they gate HTTP
            grpc_context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            grpc_context.set_details(UNAUTHENTICATED)
            raise PermissionError(UNAUTHENTICATED)  # Serve's proxy answers with the code set above
        try:
            if isinstance(request, UnreadableRequest):  # protos.read_generate_request could not read it
                raise InvalidRequestError(request.reason)
            if request.model and request.model != self.config.model_id:
                raise InvalidRequestError(f"the model `{request.model}` does not exist; this server serves "
                                          f"`{self.config.model_id}`")
            if request.WhichOneof("input") == "messages":
                prompt_ids = self._chat_ids([{"role": self._grpc_role(m.role), "content": m.content}
                                             for m in request.messages.messages])
            elif request.prompt:
                prompt_ids = list(self.tokenizer(request.prompt)["input_ids"])
            else:
                raise InvalidRequestError("prompt or messages is required")
            p = request.params
            params = self._sampling(prompt_ids, p.max_tokens or None, temperature=p.temperature,
                                    top_p=p.top_p or 1.0, top_k=p.top_k, seed=p.seed if p.HasField("seed") else None,
                                    stop=list(p.stop), ignore_eos=p.ignore_eos, **processor_fields_from_pb(p),
                                    **logprob_fields_from_pb(p), **text_fields_from_pb(p),
                                    cache_salt=cache_salt_from_pb(p), prediction=prediction_from_pb(p))
            if params.structured_outputs is not None:
                await asyncio.to_thread(grammar.check, params.structured_outputs, self.vocab_size)
        except InvalidRequestError as e:
            grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            grpc_context.set_details(str(e))
            raise  # Serve's proxy answers with the code set above
        gamma = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        async for chunk in self._run(prompt_ids, params, gamma):
            match chunk:
                case ErrorChunk():
                    grpc_context.set_code(ERROR_STATUS.get(chunk.type, (500, grpc.StatusCode.INTERNAL))[1])
                    grpc_context.set_details(chunk.message)
                    raise InvalidRequestError(chunk.message)
                case PromptChunk():  # params.prompt_logprobs: before any token, tokens 1 .. of the prompt
                    yield pb.GenerateResponse(prompt_tokens=len(prompt_ids),
                                              prompt_logprobs=logprobs_to_pb(chunk.logprobs))
                case TokensChunk():
                    yield pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, prompt_tokens=len(prompt_ids),
                                              logprobs=logprobs_to_pb(chunk.logprobs or ()))
                case FinishChunk():
                    s = chunk.stats
                    yield pb.GenerateResponse(
                        text=chunk.text, prompt_tokens=len(prompt_ids), finish_reason=chunk.finish_reason,
                        completion_tokens=chunk.completion_tokens, stats=pb.SpeculationStats(
                            drafted=s["drafted"], accepted=s["accepted"], acceptance_rate=s["acceptance_rate"],
                            mean_accepted_length=s["mean_accepted_length"], rounds=s["rounds"],
                            accepted_per_position=s["accepted_per_position"],
                            drafted_per_position=s["drafted_per_position"]))

    @staticmethod
    def _grpc_role(role: str) -> str:
        if role not in GRPC_ROLES:
            raise InvalidRequestError(f"messages: role {role[:40]!r} is not one of {', '.join(GRPC_ROLES)}")
        return GRPC_ROLES[role]

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check: SERVING once this replica runs (Serve only routes to live ones)."""
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
