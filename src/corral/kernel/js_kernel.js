// Corral's JavaScript kernel: runs INSIDE a sandbox under node, one process per interpreter.
// The same line protocol as python_kernel.py (one JSON object per line):
//   host -> kernel on stdin   {"id": N, "code": "...", "env": {...}?}
//   kernel -> host on stdout  {"type": "ready"} | {"type": "stdout"|"stderr", "id", "text"}
//                             | {"type": "result", "id", "main", "data": {"text", "html", ...}}
//                             | {"type": "error", "id", "name", "value", "traceback"} | {"type": "done", "id"}
// Cells run in one vm context: top-level var, let, const and functions survive across cells (as
// separate <script>s share a page); the value of the last expression is the main result.  A
// SIGINT interrupts the running cell (breakOnSigint) and the context survives.
// Standard library of node only.
"use strict";
const fs = require("fs");
const vm = require("vm");
const util = require("util");
const readline = require("readline");
const { Writable } = require("stream");

const current = { id: 0 };
// as python_kernel.py's FRAME_TEXT: the host drops a frame past the cell's output budget whole, so
// output goes in frames it can keep a part of, and an error is cut to its beginning and end (a
// 40 MB message was dropped, and the failed cell read as one that succeeded)
const FRAME_TEXT = 65536;
function send(message) {
  fs.writeSync(1, JSON.stringify(message) + "\n");
}
function cut(text) {
  if (text.length <= FRAME_TEXT) return text;
  const keep = FRAME_TEXT / 2 - 64;
  return `${text.slice(0, keep)}\n... (${text.length - 2 * keep} characters cut) ...\n${text.slice(-keep)}`;
}
function capture(stream) {
  return new Writable({
    write(chunk, _encoding, done) {
      const text = chunk.toString();
      for (let start = 0; start < text.length; start += FRAME_TEXT) {
        send({ type: stream, id: current.id, text: text.slice(start, start + FRAME_TEXT) });
      }
      done();
    },
  });
}
function formats(value) {
  const data = {};
  if (value !== null && typeof value === "object") {
    for (const [key, method] of [["html", "_repr_html_"], ["markdown", "_repr_markdown_"], ["svg", "_repr_svg_"],
                                 ["png", "_repr_png_"], ["json", "_repr_json_"], ["latex", "_repr_latex_"]]) {
      if (typeof value[method] === "function") {
        try { data[key] = value[method](); } catch (_) { /* a failing repr is skipped */ }
      }
    }
  }
  data.text = typeof value === "string" ? value : util.inspect(value);
  return data;
}
const sandboxConsole = new console.Console({ stdout: capture("stdout"), stderr: capture("stderr") });
const context = vm.createContext({
  console: sandboxConsole,
  display: (value) => send({ type: "result", id: current.id, main: false, data: formats(value) }),
  require, process, Buffer, setTimeout, clearTimeout, setInterval, clearInterval, URL, TextEncoder, TextDecoder,
});
process.on("SIGINT", () => {}); // between cells an interrupt changes nothing
let count = 0;

function cellFrames(stack) {
  // the kernel's own frames (vm, readline) say nothing about the cell
  const lines = stack.split("\n");
  const cut = lines.findIndex((line) => line.includes("node:vm") || line.includes("js_kernel"));
  return (cut < 0 ? lines : lines.slice(0, cut)).join("\n");
}

function runCell(id, code, env) {
  count += 1;
  current.id = id;
  const saved = {};
  for (const [name, value] of Object.entries(env || {})) {
    saved[name] = process.env[name];
    process.env[name] = value;
  }
  try {
    const script = new vm.Script(code, { filename: `<cell-${count}>` });
    const value = script.runInContext(context, { breakOnSigint: true, displayErrors: false });
    if (value !== undefined) {
      send({ type: "result", id, main: true, data: formats(value) });
    }
  } catch (error) {
    const isError = error instanceof Error || (error && typeof error.stack === "string");
    const interrupted = isError && /Script execution (was )?interrupted/.test(String(error.message));
    send({
      type: "error", id,
      name: interrupted ? "KeyboardInterrupt" : (isError ? error.name : "Error"),
      value: cut(isError ? String(error.message) : util.inspect(error)),
      traceback: isError ? cut(cellFrames(String(error.stack))) : "",
    });
  } finally {
    for (const [name, value] of Object.entries(saved)) {
      if (value === undefined) delete process.env[name]; else process.env[name] = value;
    }
  }
  send({ type: "done", id });
}

send({ type: "ready", pid: process.pid, node: process.version });
const requests = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
requests.on("line", (line) => {
  let request;
  try {
    request = JSON.parse(line);
    if (typeof request.id !== "number" || typeof request.code !== "string") throw new Error("id and code");
  } catch (error) {
    send({ type: "error", id: 0, name: "ProtocolError", value: String(error.message), traceback: "" });
    return;
  }
  runCell(request.id, request.code, request.env);
});
requests.on("close", () => process.exit(0));
