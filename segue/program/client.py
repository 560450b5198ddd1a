"""Client library for the programs API: Parrot-style semantic functions in plain Python.

    from segue.program.client import Client, semantic_function

    @semantic_function(max_tokens=64)
    def write_code(task):
        '''You are an expert software engineer. Write Python code for {{input:task}}.
        Code: {{output:code}}'''

    with Client("http://127.0.0.1:8000", api_key="sk-...").program() as p:
        code = write_code(p.variable("a snake game"))
        print(code.get(criteria="latency"))

Calling a semantic function submits it and returns its output variable at once; submissions run
on a thread pool, a call's request leaving as soon as its inputs have server ids (not values), so
a whole DAG is on the server after one round trip per dependency level, and values flow between
calls there. Only `get` waits for a value.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextvars
import inspect
import threading
import time
from typing import Any, Callable

import httpx

from segue.program.template import Template

_current: contextvars.ContextVar["RemoteProgram | None"] = contextvars.ContextVar("segue_program", default=None)


class ProgramAPIError(RuntimeError):
    """The server refused a request (bad template, unknown variable, ...)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.code = status, message, code


class ProgramStepError(ProgramAPIError):
    """A step the variable depends on failed; `step` is the id of the call that failed first."""

    def __init__(self, message: str, step: str | None) -> None:
        super().__init__(424, message, "variable_failed")
        self.step = step


def strip() -> dict[str, Any]:
    return {"type": "strip"}


def json_field(path: str) -> dict[str, Any]:
    return {"type": "json_field", "path": path}


def regex(pattern: str, group: int = 0) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern, "group": group}


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 120.0, transport: httpx.BaseTransport | None = None,
                 max_workers: int = 32) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)
        self.pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="segue-program")

    def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                err = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                raise ProgramAPIError(response.status_code, response.text) from None
            if response.status_code == 424:
                raise ProgramStepError(err.get("message", ""), err.get("param"))
            raise ProgramAPIError(response.status_code, err.get("message", ""), err.get("code"))
        return response.json()

    def program(self) -> "RemoteProgram":
        return RemoteProgram(self)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteProgram:
    """The client's handle of one program (a server-side session: segue/program/state.py's Program).
    As a context manager it is the default program of semantic functions called inside it, and it
    is deleted on exit."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.id: str = client.request("POST", "/v1/programs", json={})["id"]
        self._token: contextvars.Token | None = None

    def variable(self, value: str | None = None, name: str = "var") -> "RemoteVariable":
        """A variable set by the client (or left empty, to set later)."""
        body: dict[str, Any] = {"program_id": self.id, "name": name}
        if value is not None:
            body["value"] = value
        var = RemoteVariable(self, name)
        var._bind(self.client.pool.submit(lambda: self.client.request("POST", "/v1/programs/variables",
                                                                      json=body)["id"]))
        return var

    def delete(self) -> None:
        self.client.request("DELETE", f"/v1/programs/{self.id}")

    def info(self) -> dict[str, Any]:
        return self.client.request("GET", f"/v1/programs/{self.id}")

    def __enter__(self) -> "RemoteProgram":
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _current.reset(self._token)
        self.delete()


class RemoteVariable:
    """A future of a server-side variable (segue/program/variables.py's SemanticVariable)."""

    def __init__(self, program: RemoteProgram, name: str) -> None:
        self.program, self.name = program, name
        self._id: cf.Future[str] | None = None
        self._bound = threading.Event()

    def _bind(self, id_future: "cf.Future[str]") -> None:
        self._id = id_future
        self._bound.set()

    @property
    def id(self) -> str:
        """The server's id (waits for the submission that creates it; raises its error)."""
        self._bound.wait()
        assert self._id is not None
        return self._id.result()

    def set(self, value: str) -> None:
        self.program.client.request("POST", f"/v1/programs/variables/{self.id}", json={"value": value})

    def get(self, criteria: str | None = "latency", timeout: float | None = None, poll_s: float = 60.0) -> str:
        """The value, waiting for it server-side; `criteria` ("latency" or "throughput") tells the
        server what to optimize for this output. Raises ProgramStepError if a step failed."""
        deadline = None if timeout is None else _now() + timeout
        while True:
            wait = poll_s if deadline is None else max(0.0, min(poll_s, deadline - _now()))
            params: dict[str, Any] = {"timeout": wait}
            if criteria is not None:
                params["criteria"] = criteria
            out = self.program.client.request("GET", f"/v1/programs/variables/{self.id}", params=params)
            if out["status"] == "ready":
                return out["value"]
            if deadline is not None and _now() >= deadline:
                raise TimeoutError(f"variable {self.name!r} was not ready within {timeout} s")


def semantic_function(template: str | None = None, *, max_tokens: int | None = None, temperature: float = 0.0,
                      stop: list[str] | None = None, transforms: list[dict[str, Any]] | None = None,
                      criteria: str | None = None,
                      **sampling: Any) -> Callable[[Callable[..., Any]], Callable[..., RemoteVariable]]:
    """Turn a function whose docstring (or `template`) is a prompt template into a semantic
    function: its parameters are the template's inputs; calling it returns the output variable."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., RemoteVariable]:
        source = template if template is not None else inspect.cleandoc(fn.__doc__ or "")
        parsed = Template.parse(source)
        signature = inspect.signature(fn)
        params = [n for n, p in signature.parameters.items() if p.kind is not p.VAR_KEYWORD]
        # def f(**inputs) takes whatever the template names (templates built at run time).
        var_kw = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        if (set(params) != set(parsed.input_names)) if var_kw is None else not set(params) <= set(parsed.input_names):
            raise ValueError(f"{fn.__name__}: parameters {params} must match the template's inputs "
                             f"{parsed.input_names}")
        options = {"max_tokens": max_tokens, "temperature": temperature, "stop": stop, "criteria": criteria,
                   "transforms": transforms or [], **sampling}
        options = {k: v for k, v in options.items() if v is not None}

        def call(*args: Any, **kwargs: Any) -> RemoteVariable:
            bound = signature.bind(*args, **kwargs)
            values = {k: v for k, v in bound.arguments.items() if k != var_kw}
            values.update(bound.arguments.get(var_kw, {}) if var_kw else {})
            program = next((v.program for v in values.values() if isinstance(v, RemoteVariable)), None)
            program = program or _current.get()
            if program is None:
                raise RuntimeError(f"{fn.__name__}: pass a RemoteVariable or call it inside `with client.program()`")
            out = RemoteVariable(program, parsed.output_name)

            def submit() -> str:
                # Plain values travel inline with the call; variables by id, once they have one.
                inputs = {k: v.id if isinstance(v, RemoteVariable) else {"value": str(v)} for k, v in values.items()}
                body = {"program_id": program.id, "template": source, "inputs": inputs, **options}
                return program.client.request("POST", "/v1/programs/calls", json=body)["output"]["id"]
            out._bind(program.client.pool.submit(submit))
            return out

        call.__name__, call.__doc__ = fn.__name__, source
        return call
    return decorate


def _now() -> float:
    return time.monotonic()
