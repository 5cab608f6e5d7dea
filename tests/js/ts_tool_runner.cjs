// The TypeScript SDK's tool runner through the relay, with its defaults: threaded (the first
// turn asks the server to hold the conversation, later ones send only the new turn) and
// falling back to full histories when told `thread_unsupported_request`.
//
// usage: node ts_tool_runner.cjs BASE_URL WORKDIR create|stream MAX_ITERATIONS
// Prints one JSON line: what each HTTP request sent (thread, message count) and got (status,
// error code), every tool call the runner ran, and the final message; or the error it raised.
"use strict";

const Anthropic = require("@anthropic-ai/sdk").default;
const { betaTool } = require("@anthropic-ai/sdk/helpers/beta/json-schema");
const { SCHEMA, runBash, report, reportFailure } = require("./bash_tool.cjs");

const [baseURL, workdir, mode, maxIterations] = process.argv.slice(2);

const exchanges = [];
const calls = [];

// The wire as the SDK used it: a thread's turns are only visible here.
async function recordingFetch(url, init) {
  const body = JSON.parse(init.body);
  const response = await fetch(url, init);
  const seen = {
    thread: body.thread ?? null,
    messages: body.messages.length,
    betas: new Headers(init.headers).get("anthropic-beta"),
    status: response.status,
    relayRequestId: response.headers.get("x-relay-request-id"),
    requestId: response.headers.get("request-id"),
  };
  if (!response.ok) {
    const error = await response.clone().json();
    seen.errorCode = error.error?.details?.error_code ?? null;
    seen.errorMessage = error.error?.message ?? null;
  }
  exchanges.push(seen);
  return response;
}

async function main() {
  const client = new Anthropic({
    baseURL, apiKey: "sk-ant-e2e-test-key", maxRetries: 0, fetch: recordingFetch,
    logLevel: "warn",
  });
  const bash = betaTool({
    name: "Bash",
    description: "Run a shell command and return its output.",
    inputSchema: SCHEMA,
    run: async ({ command }, context) => {
      const { output, failed } = await runBash(command, workdir);
      calls.push({ id: context?.toolUseBlock?.id ?? null, command, output });
      if (failed) throw new Error(output);
      return output;
    },
  });
  const runner = client.beta.messages.toolRunner({
    model: "claude-e2e-test",
    max_tokens: 1024,
    max_iterations: Number(maxIterations),
    messages: [{ role: "user", content: "Run the tool until you are done." }],
    tools: [bash],
    stream: mode === "stream",
  });
  const kinds = {};
  for await (const item of runner) {
    if (mode === "stream") {
      for await (const event of item) kinds[event.type] = (kinds[event.type] || 0) + 1;
    }
  }
  const final = await runner.runUntilDone();
  if (mode === "stream" && !kinds.content_block_delta) {
    throw new Error(`the streams had no deltas: ${JSON.stringify(kinds)}`);
  }
  report({
    exchanges,
    calls,
    final: { stop_reason: final.stop_reason, text: final.content.at(-1)?.text ?? null },
  });
}

main().catch((error) => {
  reportFailure(error);
  // What the runner sent before it gave up is the diagnosis.
  process.stderr.write(JSON.stringify({ exchanges, calls }) + "\n");
});
