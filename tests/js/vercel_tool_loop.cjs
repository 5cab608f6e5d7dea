// The Vercel AI SDK's own tool loop through the relay: generateText or streamText with a Bash
// tool and a step limit, the SDK executing every call and sending the results back itself.
//
// usage: node vercel_tool_loop.cjs BASE_URL WORKDIR generate|stream MAX_STEPS
// Prints one JSON line: every step's tool calls and results, finish reason, the relay's
// x-relay-rewrites header and the final text; or the error the SDK raised.
"use strict";

const { generateText, streamText, tool, jsonSchema, stepCountIs } = require("ai");
const { createAnthropic } = require("@ai-sdk/anthropic");
const { SCHEMA, runBash, report, reportFailure } = require("./bash_tool.cjs");

const [baseURL, workdir, mode, maxSteps] = process.argv.slice(2);

async function main() {
  const anthropic = createAnthropic({ baseURL: `${baseURL}/v1`, apiKey: "sk-ant-e2e-test-key" });
  const request = {
    model: anthropic("claude-e2e-test"),
    prompt: "Run the tool until you are done.",
    maxOutputTokens: 1024,
    // A retry would hide the very 400 or 429 the test looks for.
    maxRetries: 0,
    stopWhen: stepCountIs(Number(maxSteps)),
    tools: {
      Bash: tool({
        description: "Run a shell command and return its output.",
        inputSchema: jsonSchema(SCHEMA),
        execute: async ({ command }) => (await runBash(command, workdir)).output,
      }),
    },
  };
  let steps;
  let text;
  if (mode === "stream") {
    let failure = null;
    const result = streamText({ ...request, onError: ({ error }) => { failure = error; } });
    // Read the stream to its end as a UI would, so every delta really went through the parser.
    const parts = {};
    for await (const part of result.fullStream) parts[part.type] = (parts[part.type] || 0) + 1;
    if (failure) throw failure;
    if (!parts["text-delta"] || !parts["tool-input-delta"]) {
      throw new Error(`the stream had no text or tool input deltas: ${JSON.stringify(parts)}`);
    }
    steps = await result.steps;
    text = await result.text;
  } else {
    const result = await generateText(request);
    steps = result.steps;
    text = result.text;
  }
  report({
    text,
    steps: steps.map((step) => ({
      finishReason: step.finishReason,
      calls: step.toolCalls.map((call) => ({ id: call.toolCallId, command: call.input.command })),
      results: step.toolResults.map((r) => ({ id: r.toolCallId, output: r.output })),
      rewrites: (step.response.headers || {})["x-relay-rewrites"] ?? null,
    })),
  });
}

main().catch(reportFailure);
