"""A W&B-shaped HTTP server on 127.0.0.1 for tests: it answers what wandb-core asks at init, while logging and
at finish (viewer, UpsertBucket, CreateRunFiles, file_stream, ...) with plausible JSON, and can stop
answering: once `hang` is set (or after `hang_after_file_stream` file_stream posts), requests hang until the
server closes, as a server that dies mid-run does. Not a mock of the wandb module: wandb talks to it over HTTP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeWandbServer:
    def __init__(self, hang_after_file_stream: int | None = None):
        self.hang_after_file_stream = hang_after_file_stream
        self.file_stream_posts = 0
        self.hang = threading.Event()
        self.closed = threading.Event()
        self.requests = []
        server = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                server.requests.append(self.path)
                if server.hang.is_set():
                    server.closed.wait()  # stop answering
                    return
                out = json.dumps(server.respond(self.path, body, self.headers.get("host"))).encode()
                if self.path.endswith("file_stream"):
                    server.file_stream_posts += 1
                    if server.hang_after_file_stream and server.file_stream_posts >= server.hang_after_file_stream:
                        server.hang.set()  # this answer is the last one
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_POST = do_PUT = do_GET = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def respond(self, path, body, host):
        try:
            q = json.loads(body) if body else {}
        except ValueError:
            q = {}
        query = q.get("query", "") if isinstance(q, dict) else ""
        v = q.get("variables") or {} if isinstance(q, dict) else {}
        if "UpsertBucket" in query:
            return {
                "data": {
                    "upsertBucket": {
                        "inserted": True,
                        "bucket": {
                            "id": "QnVja2V0",
                            "name": v.get("name") or "run",
                            "displayName": v.get("displayName") or "run",
                            "description": "",
                            "config": "{}",
                            "sweepName": None,
                            "historyLineCount": 0,
                            "eventsLineCount": 0,
                            "summaryMetrics": "{}",
                            "project": {
                                "id": "UHJvamVjdA==",
                                "name": v.get("project") or "p",
                                "entity": {"id": "RW50", "name": "e"},
                            },
                        },
                    }
                }
            }
        if "viewer" in query:
            return {
                "data": {
                    "viewer": {
                        "id": "VXNlcg==",
                        "entity": "e",
                        "username": "u",
                        "email": "",
                        "flags": "{}",
                        "teams": {"edges": []},
                    }
                }
            }
        if "CreateRunFiles" in query:
            return {
                "data": {
                    "createRunFiles": {
                        "runID": "cnVu",
                        "uploadHeaders": [],
                        "files": [{"name": f, "uploadUrl": f"http://{host}/upload/{f}"} for f in v.get("files", [])],
                    }
                }
            }
        if "serverInfo" in query:
            return {"data": {"serverInfo": {"features": [], "latestLocalVersionInfo": None}}}
        if "entity(" in query:
            return {"data": {"entity": {"organization": None}}}
        if path.endswith("file_stream"):
            return {"exitcode": None, "limits": {}}
        return {"data": {}}

    def close(self):
        self.closed.set()
        self.httpd.shutdown()
        self.httpd.server_close()
