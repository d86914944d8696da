// openai-node's responses.stream() against the gateway: prints one JSON line with what the client saw.
// usage: node responses_stream.mjs BASE_URL MODEL PROMPT
import OpenAI from "openai";

const [baseURL, model, prompt] = process.argv.slice(2);
const tiers = []; // x-tiergate-tier of every response the client got, read off the wire by its own fetch
const client = new OpenAI({
  baseURL,
  apiKey: "unused",
  maxRetries: 0,
  fetch: async (url, init) => {
    const response = await fetch(url, init);
    tiers.push(response.headers.get("x-tiergate-tier"));
    return response;
  },
});
const stream = client.responses.stream({ model, input: prompt });
const types = [];
let text = "";
for await (const event of stream) {
  types.push(event.type);
  if (event.type === "response.output_text.delta") text += event.delta;
}
const final = await stream.finalResponse();
console.log(JSON.stringify({
  tiers,
  types,
  text,
  final_text: final.output_text,
  status: final.status,
  output_tokens: final.usage?.output_tokens,
}));
