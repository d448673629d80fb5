"""The ingress's FastAPI application: the one `app` the routes of `deployments/ingress.py` and
`deployments/ingress_compat.py` are registered on, its OpenAPI document and its error bodies."""

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.openai_body import error_response
from deployments.openai_responses import openapi_document

app = FastAPI(title="tandem", description="OpenAI-compatible API over lossless pipelined speculative decoding.")
app.openapi = lambda: openapi_document(app)


def unauthorized():
    return error_response(401, "invalid or missing API key (Authorization: Bearer ..., or x-api-key)",
                          code="invalid_api_key")


@app.exception_handler(StarletteHTTPException)
async def _on_http_error(request: Request, e: StarletteHTTPException):
    return error_response(e.status_code, str(e.detail), type_="invalid_request_error")


@app.exception_handler(Exception)
async def _on_server_error(request: Request, e: Exception):
    """A bug, not the client's fault: still an OpenAI-style body (Starlette logs the traceback)."""
    return error_response(500, f"internal error: {type(e).__name__}", type_="server_error")
