"""A small in-memory Hugging Face Hub for tests: the HTTP API as `huggingface_hub` 2.x speaks it, on 127.0.0.1.

The real client code (huggingface_hub, transformers, peft) runs unchanged against it; only the endpoint differs.
What it serves (model repos only):

* `POST /api/repos/create`, `POST /api/validate-yaml` (README metadata, checked before every commit that has one)
* `GET /api/models/{repo}[/revision/{rev}]` (model info), `GET /api/models/{repo}/tree/{rev}[/{path}]`
* `POST /api/models/{repo}/preupload/{rev}`, `POST /api/models/{repo}/commit/{rev}` (ndjson),
  `POST /api/models/{repo}/branch/{name}`
* `HEAD|GET /{repo}/resolve/{rev}/{path}` with the headers `hf_hub_download` relies on: `X-Repo-Commit`, `ETag`
  (git blob sha1), and for LFS-tracked names `X-Linked-Etag`/`X-Linked-Size` (sha256 and size, as the Hub sends).
* 404s carry `X-Error-Code` RepoNotFound / RevisionNotFound / EntryNotFound, which the client maps to its errors.

Every commit gets a 40-hex sha; a revision is a branch name or a commit sha, so `revision=` pinning works.

Preupload answers "regular" for every file, so file contents travel base64-encoded inside the commit call: with
`hf_xet` installed the client would upload "lfs" files through Xet storage, which cannot be faked here, and it
accepts "regular" for any size. Responses never carry Xet headers, so downloads stay plain HTTP.
"""

import base64
import contextlib
import datetime
import fnmatch
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest


USER = "tester"
# Names the Hub's default .gitattributes sends to LFS (the ones that matter for model repos).
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle", "*.h5", "*.gguf")
GITATTRIBUTES = b"".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n".encode() for p in LFS_PATTERNS)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return any(fnmatch.fnmatch(path.rsplit("/", 1)[-1], p) for p in LFS_PATTERNS)


@dataclass
class Commit:
    sha: str
    files: dict  # path -> bytes (the full tree at this commit)
    summary: str
    date: str


@dataclass
class Repo:
    repo_id: str
    commits: dict = field(default_factory=dict)  # sha -> Commit
    branches: dict = field(default_factory=dict)  # name -> sha

    def resolve(self, revision: str) -> Commit | None:
        sha = self.branches.get(revision, revision)
        return self.commits.get(sha)

    def commit(self, branch: str, files: dict, summary: str) -> Commit:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        seed = json.dumps([self.repo_id, branch, self.branches.get(branch), sorted(files), summary, len(self.commits)])
        sha = hashlib.sha1(seed.encode() + b"".join(files[p] for p in sorted(files))).hexdigest()
        self.commits[sha] = Commit(sha, files, summary, date)
        self.branches[branch] = sha
        return self.commits[sha]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers or {}


class FakeHub:
    """The state (repos, commits) and the HTTP server; `requests` logs (method, path, status) of every call."""

    def __init__(self):
        self.user = USER
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, int]] = []
        self.problems: list[str] = []  # routes this fake does not serve, and its own crashes: tests assert none
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "FakeHub":
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo_id: str, revision: str = "main") -> dict:
        """path -> bytes of a repo at a revision, for assertions."""
        return dict(self.repos[repo_id].resolve(revision).files)

    # ---- request handling (called with the lock held) ----

    def repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HubError(404, f"Repository {repo_id} not found.", "RepoNotFound")
        return self.repos[repo_id]

    def at(self, repo_id: str, revision: str) -> tuple[Repo, Commit]:
        repo = self.repo(repo_id)
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo, commit

    def create_repo(self, body: dict) -> tuple[int, dict]:
        repo_id = f"{body.get('organization') or USER}/{body['name']}"
        answer = {"url": f"{self.url}/{repo_id}", "name": repo_id, "id": repo_id}
        if repo_id in self.repos:
            return 409, {**answer, "error": "You already created this model repo"}
        self.repos[repo_id] = repo = Repo(repo_id)
        repo.commit("main", {".gitattributes": GITATTRIBUTES}, "initial commit")  # as the Hub does
        return 200, answer

    def info(self, repo_id: str, revision: str) -> dict:
        repo, commit = self.at(repo_id, revision)
        return {
            "_id": repo_id,
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit.sha,
            "lastModified": commit.date,
            "private": False,
            "disabled": False,
            "gated": False,
            "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        }

    def entry(self, path: str, data: bytes) -> dict:
        item = {"type": "file", "oid": git_sha1(data), "size": len(data), "path": path}
        if is_lfs(path):
            item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return item

    def tree(self, repo_id: str, revision: str, folder: str, recursive: bool) -> list:
        _, commit = self.at(repo_id, revision)
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        entries, folders = [], set()
        for path, data in sorted(commit.files.items()):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entries.append(self.entry(path, data))
        if prefix and not entries and not folders:
            raise HubError(404, f"{folder} does not exist on {revision}", "EntryNotFound")
        dirs = [{"type": "directory", "oid": git_sha1(d.encode()), "size": 0, "path": d} for d in sorted(folders)]
        return dirs + entries

    def preupload(self, repo_id: str, revision: str, body: dict) -> dict:
        repo = self.repo(repo_id)
        commit = repo.resolve(revision) or repo.resolve("main")
        files = []
        for item in body["files"]:
            existing = commit.files.get(item["path"])
            oid = git_sha1(existing) if existing is not None else None
            files.append({"path": item["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        return {"files": files, "commitOid": commit.sha}

    def commit(self, repo_id: str, revision: str, lines: list) -> dict:
        repo = self.repo(repo_id)
        if revision not in repo.branches:
            raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch)", "RevisionNotFound")
        head = repo.resolve(revision)
        files, summary = dict(head.files), ""
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "header":
                summary = value.get("summary", "")
                if value.get("parentCommit") not in (None, head.sha):
                    raise HubError(412, f"parentCommit {value['parentCommit']} is not the head of {revision}")
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(folder)}
            else:  # "lfsFile"/"copyFile" never come: preupload answers "regular" for everything
                raise HubError(400, f"unsupported commit operation {key!r} in the fake Hub")
        new = repo.commit(revision, files, summary)
        return {"success": True, "commitOid": new.sha, "commitUrl": f"{self.url}/{repo_id}/commit/{new.sha}"}

    def create_branch(self, repo_id: str, branch: str, body: dict) -> dict:
        repo = self.repo(repo_id)
        if branch in repo.branches:
            raise HubError(409, f"Reference refs/heads/{branch} already exists")
        _, start = self.at(repo_id, body.get("startingPoint") or "main")
        repo.branches[branch] = start.sha
        return {}

    def resolve_file(self, repo_id: str, revision: str, path: str) -> tuple[bytes, dict]:
        _, commit = self.at(repo_id, revision)
        if path not in commit.files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        data = commit.files[path]
        headers = {
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{git_sha1(data)}"',
            "Content-Type": "application/octet-stream",
        }
        if is_lfs(path):
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
        return data, headers


def _handler_for(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

        def log_message(self, *args):  # quiet: the test log stays readable
            pass

        def do_HEAD(self):
            self.handle_request(send_body=False)

        def do_GET(self):
            self.handle_request()

        def do_POST(self):
            self.handle_request()

        def read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().strip(), 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def handle_request(self, send_body=True):
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]  # revisions arrive quoted ("refs%2Fpr%2F1")
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            body = self.read_body() if self.command == "POST" else b""
            try:
                with hub.lock:
                    status, payload, headers = self.route(parts, query, body)
            except Exception as error:
                if not isinstance(error, HubError):  # a bug in this fake, not a client error: answer 500, record it
                    hub.problems.append(f"{self.command} {url.path}: {type(error).__name__}: {error}")
                    error = HubError(500, f"fake Hub crashed: {error}")
                status, payload = error.status, json.dumps({"error": str(error)}).encode()
                headers = {**error.headers, "X-Error-Message": str(error), "Content-Type": "application/json"}
                if error.code:
                    headers["X-Error-Code"] = error.code
            hub.requests.append((self.command, url.path, status))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if send_body:
                self.wfile.write(payload)

        def route(self, parts, query, body):
            as_json = {"Content-Type": "application/json"}
            write = self.command == "POST" and parts[:2] != ["api", "validate-yaml"]
            if write and not self.headers.get("Authorization", "").startswith("Bearer "):
                raise HubError(401, "Invalid credentials in Authorization header")
            match self.command, parts:
                case "POST", ["api", "repos", "create"]:
                    status, answer = hub.create_repo(json.loads(body))
                    return status, json.dumps(answer).encode(), as_json
                case "POST", ["api", "validate-yaml"]:
                    return 200, b'{"errors": [], "warnings": []}', as_json
                case "GET", ["api", "models", ns, name]:
                    return 200, json.dumps(hub.info(f"{ns}/{name}", "main")).encode(), as_json
                case "GET", ["api", "models", ns, name, "revision", *rev]:
                    return 200, json.dumps(hub.info(f"{ns}/{name}", "/".join(rev))).encode(), as_json
                case "GET", ["api", "models", ns, name, "tree", rev, *folder]:
                    recursive = query.get("recursive", "").lower() in ("1", "true")
                    tree = hub.tree(f"{ns}/{name}", rev, "/".join(folder), recursive)
                    return 200, json.dumps(tree).encode(), as_json
                case "POST", ["api", "models", ns, name, "preupload", rev]:
                    return 200, json.dumps(hub.preupload(f"{ns}/{name}", rev, json.loads(body))).encode(), as_json
                case "POST", ["api", "models", ns, name, "commit", rev]:
                    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                    return 200, json.dumps(hub.commit(f"{ns}/{name}", rev, lines)).encode(), as_json
                case "POST", ["api", "models", ns, name, "branch", branch]:
                    answer = hub.create_branch(f"{ns}/{name}", branch, json.loads(body or b"{}"))
                    return 200, json.dumps(answer).encode(), as_json
                case (("GET" | "HEAD"), [ns, name, "resolve", rev, *path]):
                    return 200, *hub.resolve_file(f"{ns}/{name}", rev, "/".join(path))
            hub.problems.append(f"{self.command} /{'/'.join(parts)}: not served")
            raise HubError(404, f"the fake Hub does not serve {self.command} /{'/'.join(parts)}")

    return Handler


@contextlib.contextmanager
def running_hub(home):
    """Start a FakeHub and point this process's huggingface_hub/transformers at it (home: a fresh directory).

    huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE into `constants` at import time, and
    two `HfApi` objects are built before any test runs (huggingface_hub's module-level `api` behind `file_exists`,
    `model_info`, ...; transformers' shared `hf_api()`), so setting the environment alone is not enough in-process:
    the same values go into those few attributes. Subprocesses get them through `hub_env`.
    """
    from huggingface_hub import constants, hf_api
    from transformers.utils import hub as transformers_hub

    hub = FakeHub().start()
    env = hub_env(hub, home)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.delenv("HF_HUB_OFFLINE", raising=False)
        patch.setattr(constants, "ENDPOINT", hub.url)
        patch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        patch.setattr(constants, "HF_HOME", env["HF_HOME"])
        patch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        patch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        patch.setattr(hf_api.api, "endpoint", hub.url)
        patch.setattr(transformers_hub, "_hf_api", None)  # rebuilt on first use, with the endpoint above
        try:
            yield hub
        finally:
            hub.stop()


def hub_env(hub: FakeHub, home) -> dict:
    """Environment variables that point a fresh interpreter at HUB, with its own cache under HOME."""
    home = os.fspath(home)
    return {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "hf_fake_token_for_tests",
        "HF_HOME": home,
        "HF_HUB_CACHE": os.path.join(home, "hub"),
        "HF_MODULES_CACHE": os.path.join(home, "modules"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
