// PocketLoRA device data pipeline in JS (Node and browser): the bundle's tokenizer, training files
// -> examples, batching and the seeded data order, all equal to ort_trainer/data.py's.
export { DataError, ValueError } from "./errors.mjs";
export { PLAIN_CHAT_TEMPLATE, TOKENIZER_FILES, TemplateError, TextTokenizer } from "./tokenizer.mjs";
export {
  ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, CHAT_ROLES, IGNORE_INDEX, SUPPORTED_EXTENSIONS, TEXT_CHUNK_LINES,
  alpacaPrompt, loadExamples, lossTokenCount, tokenizeText,
} from "./records.mjs";
export { DataOrder, collate, dataOrder, stepBatches } from "./batching.mjs";
export { defaultRng } from "./nprandom.mjs";
