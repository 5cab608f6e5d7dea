// The Bash tool both JS clients run for real, as an agent does: in the scratch directory the
// test gives, bounded in time and output, its output (or failure) being the result.
"use strict";

const { execFile } = require("node:child_process");

const TIMEOUT_MS = 10000;
const MAX_OUTPUT = 64 * 1024;

const SCHEMA = {
  type: "object",
  properties: { command: { type: "string" } },
  required: ["command"],
};

function runBash(command, cwd) {
  return new Promise((resolve) => {
    // --norc: bash takes the socket node gives it for stdin as a remote shell's, and would
    // read ~/.bashrc.
    execFile("bash", ["--norc", "-c", command], { cwd, timeout: TIMEOUT_MS, maxBuffer: MAX_OUTPUT },
      (error, stdout, stderr) => {
        const output = stdout + stderr;
        resolve({ output: output || "(no output)", failed: error !== null });
      });
  });
}

// One line of JSON on stdout for pytest to read; anything else the clients print goes to stderr.
function report(value) {
  process.stdout.write(JSON.stringify(value) + "\n");
}

// A client error as data: the test wants the status and the body the relay answered with.
function reportFailure(error) {
  report({
    error: {
      name: error && error.name,
      message: String(error && error.message),
      status: error && (error.status ?? error.statusCode ?? null),
      body: error && (error.error ?? error.responseBody ?? null),
    },
  });
  process.exitCode = 1;
}

module.exports = { SCHEMA, runBash, report, reportFailure };
