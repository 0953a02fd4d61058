// Training data files -> examples (input_ids + labels), exactly as ort_trainer/data.py's
// load_examples: the same formats, label masking, truncate/drop policy, report, warnings and
// one-line DataError messages. See data.py's module docstring for the policy; in short:
//
// .txt    the whole text tokenized without special tokens (in chunks of TEXT_CHUNK_LINES lines cut
//         where cutting does not change the ids, as Python does), the special prefix (e.g. BOS) once
//         at the start, packed into consecutive blocks of exactly seqLen tokens, tail dropped;
//         labels == input_ids.
// .jsonl / .json   instruction records {"instruction", "input"?, "output", "system"?} or chat records
//         {"messages": [{role, content}]} (plus {"text"} records mixed in). With a chat template the
//         assistant turns (content + the end-of-turn text the template renders) carry loss, found by
//         rendering conversation prefixes; without one, instruction records use the Alpaca prompt and
//         output + EOS carries loss, chat records use PLAIN_CHAT_TEMPLATE. -100 everywhere else.
//
// `path` is used only for the extension and, verbatim, in messages (Python prints str(Path(path))).

import { DataError } from "./errors.mjs";
import { JSONDecodeError, loads, rawDecode, skipWs } from "./pyjson.mjs";
import { cmpCodePoints, isBlank, isDict, pyRepr, splitlines, strRepr, typeName } from "./pystr.mjs";
import { TemplateError } from "./tokenizer.mjs";
import { UnicodeDecodeError, decodeUtf8Sig } from "./utf8.mjs";

export const IGNORE_INDEX = -100;
export const TEXT_CHUNK_LINES = 1000;
export const TEXT_SEAM_PROBE = 4;
export const TEXT_SEAM_SEARCH = 32;
export const TEXT_SEAM_MAX_WIDEN = 256;
export const SUPPORTED_EXTENSIONS = [".txt", ".jsonl", ".json"];
export const CHAT_ROLES = ["system", "user", "assistant"];

export const ALPACA_PROMPT =
  "Below is an instruction that describes a task. Write a response that appropriately completes " +
  "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";
export const ALPACA_PROMPT_WITH_INPUT =
  "Below is an instruction that describes a task. Write a response that appropriately completes " +
  "the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";

/** The Alpaca prompt (used without a chat template); the Input block is omitted when empty. */
export function alpacaPrompt(instruction, input = "") {
  const tpl = input ? ALPACA_PROMPT_WITH_INPUT : ALPACA_PROMPT;
  // str.format: substitute once, never re-reading the substituted values
  return tpl.replace(/\{(instruction|input)\}/g, (_, k) => (k === "instruction" ? instruction : input));
}

/** Positions HF's shifted causal-LM loss averages over: labels[1:] != -100. */
export function lossTokenCount(labels) {
  let n = 0;
  for (let i = 1; i < labels.length; i++) if (Number(labels[i]) !== IGNORE_INDEX) n++;
  return n;
}

function suffixOf(path) {
  const name = path.split("/").pop();
  const i = name.lastIndexOf(".");
  return i > 0 && i < name.length - 1 ? name.slice(i) : "";
}

function makeReport(fields) {
  const r = { path: "", kind: "", records: 0, examples: 0, truncated: 0, dropped: 0, tokens: 0,
    label_tokens: 0, warnings: [], seq_len: 0, dropped_tokens: 0, ...fields };
  r.summary = () => `${r.path}: ${r.kind}, ${r.records} records -> ${r.examples} examples ` +
    `(seq_len ${r.seq_len}; ${r.truncated} truncated, ${r.dropped} dropped), ` +
    `${r.tokens} tokens, ${r.label_tokens} loss tokens`;
  return r;
}

/**
 * Load a .txt, .jsonl or .json file's contents (bytes: Uint8Array/ArrayBuffer, decoded as UTF-8
 * with an optional BOM; or an already decoded string) into examples of at most seqLen tokens.
 * Returns {examples: [{input_ids: Int32Array, labels: Int32Array}], report}.
 */
export function loadExamples(path, data, tokenizer, seqLen) {
  const p = String(path);
  const suffix = suffixOf(p);
  const ext = suffix.toLowerCase();
  if (!SUPPORTED_EXTENSIONS.includes(ext)) {
    throw new DataError(`${p}: unsupported file type ${strRepr(suffix || "(no extension)")}; supported: ` +
      ".txt (plain text), .jsonl (one JSON object per line), .json (a JSON list of objects)");
  }
  if (!Number.isInteger(seqLen) || seqLen < 2) {
    throw new DataError(`${p}: seq_len must be an integer >= 2 (got ${pyRepr(seqLen)})`);
  }
  if (data === null || data === undefined) throw new DataError(`${p}: file not found`);
  let text;
  if (typeof data === "string") {
    text = data.startsWith("\ufeff") ? data.slice(1) : data;
  } else {
    const raw = data instanceof Uint8Array ? data : new Uint8Array(data);
    try {
      text = decodeUtf8Sig(raw);
    } catch (e) {
      if (!(e instanceof UnicodeDecodeError)) throw e;
      let line = 1;
      for (let i = 0; i < e.start && i < raw.length; i++) if (raw[i] === 0x0a) line++;
      throw new DataError(`${p} line ${line}: not valid UTF-8 (${e.reason} at byte ${e.start}); save the file as UTF-8`);
    }
  }
  text = text.replaceAll("\r\n", "\n").replaceAll("\r", "\n");
  if (ext === ".txt") return loadText(p, text, tokenizer, seqLen);
  const records = ext === ".jsonl" ? parseJsonl(p, text) : parseJsonList(p, text);
  return loadRecords(p, records, tokenizer, seqLen);
}

// --------------------------------------------------------------------------------------------
// Plain text
// --------------------------------------------------------------------------------------------

function probeWindow(lines, c) {
  const k = Math.max(1, TEXT_SEAM_PROBE);
  let lo = Math.max(0, c - k);
  while (lo > 0 && isBlank(lines[lo])) {
    lo -= 1;
    if (c - lo > TEXT_SEAM_MAX_WIDEN) return null;
  }
  let hi = Math.min(lines.length, c + k);
  while (hi < lines.length && isBlank(lines[hi - 1])) {
    hi += 1;
    if (hi - c > TEXT_SEAM_MAX_WIDEN) return null;
  }
  return [lines.slice(lo, c).join(""), lines.slice(c, hi).join("")];
}

const sameIds = (a, b, c) => a.length === b.length + c.length &&
  b.every((v, i) => a[i] === v) && c.every((v, i) => a[b.length + i] === v);

function safeSeams(tokenizer, lines, nominal) {
  const chosen = new Map();
  for (let r = 0; r < Math.max(1, TEXT_SEAM_SEARCH); r++) {
    const todo = nominal.filter((b) => !chosen.has(b) && b + r < lines.length);
    if (!todo.length) break;
    const probes = todo.map((b) => [b, probeWindow(lines, b + r)]).filter(([, w]) => w !== null);
    for (const [b, [left, right]] of probes) {
      const whole = tokenizer.encode(left + right, false);
      if (sameIds(whole, tokenizer.encode(left, false), tokenizer.encode(right, false))) chosen.set(b, b + r);
    }
  }
  return [nominal.map((b) => (chosen.has(b) ? chosen.get(b) : b)), nominal.filter((b) => !chosen.has(b)).length];
}

/** Python _tokenize_text: id pieces of a long text tokenized as if in one piece, and the unsafe cut count. */
function tokenizeTextPieces(tokenizer, text) {
  const lines = splitlines(text, true);
  const c = Math.max(1, TEXT_CHUNK_LINES);
  if (lines.length <= c) return [[tokenizer.encode(text, false)], 0];
  const nominal = [];
  for (let b = c; b < lines.length; b += c) nominal.push(b);
  const [seams, unsafe] = safeSeams(tokenizer, lines, nominal);
  const bounds = [...new Set([0, ...seams, lines.length])].sort((a, b) => a - b);
  const pieces = [];
  for (let i = 0; i + 1 < bounds.length; i++) {
    pieces.push(tokenizer.encode(lines.slice(bounds[i], bounds[i + 1]).join(""), false));
  }
  return [pieces, unsafe];
}

function concatIds(prefix, pieces) {
  const total = prefix.length + pieces.reduce((n, x) => n + x.length, 0);
  const ids = new Int32Array(total);
  ids.set(prefix, 0);
  let o = prefix.length;
  for (const piece of pieces) {
    ids.set(piece, o);
    o += piece.length;
  }
  return ids;
}

/** The token stream of a plain text exactly as the .txt path builds it (before packing). */
export function tokenizeText(text, tokenizer) {
  return concatIds(tokenizer.prefixIds, tokenizeTextPieces(tokenizer, text)[0]);
}

function loadText(p, text, tokenizer, seqLen) {
  const linesCount = splitlines(text).length;
  if (isBlank(text)) throw new DataError(`${p}: the file has no text; put plain training text in it`);
  const [pieces, unsynced] = tokenizeTextPieces(tokenizer, text);
  const ids = concatIds(tokenizer.prefixIds, pieces);
  const total = ids.length;
  const nBlocks = Math.floor(total / seqLen);
  const tail = total - nBlocks * seqLen;
  if (nBlocks === 0) {
    throw new DataError(`${p}: the file has ${total} tokens, fewer than seq_len=${seqLen}, so no training block ` +
      "can be made; use a smaller seq_len or more text");
  }
  const examples = [];
  for (let i = 0; i < nBlocks; i++) {
    const block = ids.slice(i * seqLen, (i + 1) * seqLen);
    examples.push({ input_ids: block, labels: block.slice() });
  }
  const warnings = [];
  if (unsynced) {
    warnings.push(`${unsynced} cuts between tokenizer chunks of ${TEXT_CHUNK_LINES} lines found no line where ` +
      "cutting leaves the tokens unchanged; a token or two there may differ from tokenizing " +
      "the file in one piece");
  }
  if (tail) {
    warnings.push(`the last ${tail} tokens (shorter than seq_len=${seqLen}) were dropped: text is packed ` +
      "into non-overlapping blocks of exactly seq_len tokens");
  }
  const report = makeReport({
    path: p, kind: "text", records: linesCount, examples: nBlocks, truncated: 0, dropped: tail ? 1 : 0,
    tokens: nBlocks * seqLen, label_tokens: nBlocks * (seqLen - 1), warnings, seq_len: seqLen, dropped_tokens: tail,
  });
  return { examples, report };
}

// --------------------------------------------------------------------------------------------
// JSON records
// --------------------------------------------------------------------------------------------

function parseJsonl(p, text) {
  const out = [];
  const lines = text.split("\n");
  for (let k = 0; k < lines.length; k++) {
    const line = lines[k];
    if (isBlank(line)) continue;
    let obj;
    try {
      obj = loads(line);
    } catch (e) {
      if (!(e instanceof JSONDecodeError)) throw e;
      throw new DataError(`${p} line ${k + 1}: invalid JSON (${e.msg} at column ${e.colno}); ` +
        "a .jsonl file needs exactly one JSON object per line");
    }
    out.push([k + 1, obj]);
  }
  return out;
}

/** Parse a JSON list, keeping the 1-based line where each element starts. */
function parseJsonList(p, text) {
  const n = text.length;
  // line_of(i): newlines before i, counted incrementally (positions only grow)
  let lineAt = 0;
  let lineNo = 1;
  const lineOf = (i) => {
    if (i < lineAt) {
      lineAt = 0;
      lineNo = 1;
    }
    for (let j = text.indexOf("\n", lineAt); j !== -1 && j < i; j = text.indexOf("\n", j + 1)) lineNo++;
    lineAt = i;
    return lineNo;
  };
  let i = skipWs(text, 0);
  if (i >= n) return [];
  if (text[i] !== "[") {
    const hint = text[i] === "{" ? " (if it has one object per line, name it .jsonl)" : "";
    throw new DataError(`${p} line ${lineOf(i)}: expected a JSON list of records [{...}, ...]${hint}`);
  }
  i = skipWs(text, i + 1);
  const out = [];
  if (i < n && text[i] === "]") {
    i += 1;
  } else {
    for (;;) {
      let obj;
      let end;
      try {
        [obj, end] = rawDecode(text, i);
      } catch (e) {
        if (!(e instanceof JSONDecodeError)) throw e;
        throw new DataError(`${p} line ${e.lineno}: invalid JSON (${e.msg} at column ${e.colno})`);
      }
      out.push([lineOf(i), obj]);
      i = skipWs(text, end);
      if (i < n && text[i] === ",") {
        i = skipWs(text, i + 1);
        continue;
      }
      if (i < n && text[i] === "]") {
        i += 1;
        break;
      }
      throw new DataError(`${p} line ${lineOf(Math.min(i, n))}: invalid JSON (expected ',' or ']' after a list element)`);
    }
  }
  i = skipWs(text, i);
  if (i < n) throw new DataError(`${p} line ${lineOf(i)}: invalid JSON (extra data after the closing ']')`);
  return out;
}

const has = (obj, key) => Object.prototype.hasOwnProperty.call(obj, key);

/** Validate one record: ["instruction", fields] | ["chat", messages] | ["text", text]. */
function checkRecord(p, lineno, rec) {
  const where = `${p} line ${lineno}`;
  if (!isDict(rec)) {
    throw new DataError(`${where}: expected a JSON object, got ${typeName(rec)}; records are ` +
      '{"instruction": ..., "output": ...} or {"messages": [...]}');
  }
  if (has(rec, "messages")) {
    const msgs = rec.messages;
    if (!Array.isArray(msgs) || !msgs.length) {
      throw new DataError(`${where}: "messages" must be a non-empty list of {"role": ..., "content": ...} objects`);
    }
    const clean = [];
    msgs.forEach((m, j) => {
      if (!isDict(m)) {
        throw new DataError(`${where}: messages[${j}] must be an object {"role": ..., "content": ...}, got ${typeName(m)}`);
      }
      for (const key of ["role", "content"]) {
        if (!has(m, key)) {
          throw new DataError(`${where}: messages[${j}] is missing key "${key}" (chat messages need "role" and "content")`);
        }
      }
      if (typeof m.role !== "string" || !CHAT_ROLES.includes(m.role)) {
        throw new DataError(`${where}: messages[${j}] has unknown role ${pyRepr(m.role)}; ` +
          `roles must be one of ${CHAT_ROLES.join(", ")}`);
      }
      if (typeof m.content !== "string") {
        throw new DataError(`${where}: messages[${j}] "content" must be a string, got ${typeName(m.content)}`);
      }
      clean.push({ role: m.role, content: m.content });
    });
    return ["chat", clean];
  }
  if (has(rec, "text") && !["messages", "instruction", "output"].some((k) => has(rec, k))) {
    if (typeof rec.text !== "string" || isBlank(rec.text)) throw new DataError(`${where}: "text" must be a non-empty string`);
    return ["text", rec.text];
  }
  if (has(rec, "instruction") || has(rec, "output")) {
    for (const key of ["instruction", "output"]) {
      if (!has(rec, key)) {
        throw new DataError(`${where}: missing key "${key}" (instruction records need "instruction" and "output")`);
      }
    }
    const fields = {};
    for (const [key, required] of [["instruction", true], ["output", true], ["input", false], ["system", false]]) {
      let v = has(rec, key) ? rec[key] : null;
      if (v === null && !required) v = "";
      if (typeof v !== "string") throw new DataError(`${where}: "${key}" must be a string, got ${typeName(v)}`);
      fields[key] = v;
    }
    return ["instruction", fields];
  }
  const keys = Object.keys(rec).sort(cmpCodePoints).join(", ") || "none";
  throw new DataError(`${where}: unknown record (keys: ${keys}); use {"instruction": ..., "input": ..., "output": ...} ` +
    'or {"messages": [{"role": ..., "content": ...}, ...]}');
}

function render(tokenizer, where, messages, gen) {
  try {
    return tokenizer.renderChat(messages, gen);
  } catch (e) {
    if (!(e instanceof TemplateError)) throw e;
    throw new DataError(`${where}: the chat template failed on this record (${e.message}); fix the record ` +
      "(e.g. role order the template accepts)");
  }
}

/** Split the rendered chat into [text, carriesLoss] segments by rendering prefixes. */
function chatSegments(tokenizer, where, messages) {
  const segs = [];
  let prev = "";
  for (let i = 0; i < messages.length; i++) {
    if (messages[i].role !== "assistant") continue;
    const prompt = render(tokenizer, where, messages.slice(0, i), true);
    const full = render(tokenizer, where, messages.slice(0, i + 1), false);
    if (!prompt.startsWith(prev) || !full.startsWith(prompt)) {
      throw new DataError(`${where}: the chat template does not render conversation prefixes as prefixes of ` +
        `the conversation (at message ${i}), so the assistant's tokens cannot be located exactly; split ` +
        "multi-turn chats into single-turn records or use another template");
    }
    segs.push([prompt.slice(prev.length), false]);
    segs.push([full.slice(prompt.length), true]);
    prev = full;
  }
  const full = render(tokenizer, where, messages, false);
  if (!full.startsWith(prev)) {
    throw new DataError(`${where}: the chat template does not render conversation prefixes as prefixes of the ` +
      "conversation, so the assistant's tokens cannot be located exactly");
  }
  segs.push([full.slice(prev.length), false]);
  return segs;
}

class TextRecord {
  constructor(text) { this.text = text; }
}

function loadRecords(p, records, tokenizer, seqLen) {
  if (!records.length) {
    throw new DataError(`${p}: no records; add instruction records ` +
      '{"instruction": ..., "output": ...} or chat records {"messages": [...]}');
  }
  let kind = null;
  let firstLine = 0;
  const checked = [];
  for (const [lineno, rec] of records) {
    const [k, payload] = checkRecord(p, lineno, rec);
    if (k === "text") {
      checked.push([lineno, new TextRecord(payload)]);
      continue;
    }
    if (kind === null) {
      kind = k;
      firstLine = lineno;
    } else if (k !== kind) {
      throw new DataError(`${p} line ${lineno}: a ${k} record in a file of ${kind} records (line ${firstLine}); ` +
        "use one record kind per file");
    }
    checked.push([lineno, payload]);
  }

  const warnings = [];
  const templated = tokenizer.hasChatTemplate;
  const eosMissing = tokenizer.eosId === null;
  kind = kind || "text";
  const chatPrefix = templated ? [] : tokenizer.prefixIds;
  const eosAfterOutput = kind === "instruction" && !templated && tokenizer.eosId !== null;
  const plans = [];
  for (const [lineno, payload] of checked) {
    const where = `${p} line ${lineno}`;
    if (payload instanceof TextRecord) {
      plans.push([tokenizer.prefixIds, [[payload.text, true]], false]);
      continue;
    }
    if (kind === "instruction" && !templated) {
      plans.push([chatPrefix, [[alpacaPrompt(payload.instruction, payload.input), false], [payload.output, true]],
        eosAfterOutput]);
      continue;
    }
    let messages;
    if (kind === "instruction") {
      const user = payload.instruction + (payload.input ? "\n\n" + payload.input : "");
      messages = payload.system ? [{ role: "system", content: payload.system }] : [];
      messages.push({ role: "user", content: user }, { role: "assistant", content: payload.output });
    } else {
      messages = payload;
    }
    plans.push([chatPrefix, chatSegments(tokenizer, where, messages), false]);
  }

  const examples = [];
  let truncated = 0;
  let dropped = 0;
  let tokens = 0;
  let labelTokens = 0;
  let droppedTokens = 0;
  for (const [prefix, segs, eosAfter] of plans) {
    let ids = [...prefix];
    let lab = new Array(prefix.length).fill(IGNORE_INDEX);
    for (const [text, loss] of segs) {
      const seg = tokenizer.encode(text, false);
      for (const t of seg) {
        ids.push(t);
        lab.push(loss ? t : IGNORE_INDEX);
      }
    }
    if (eosAfter) {
      ids.push(tokenizer.eosId);
      lab.push(tokenizer.eosId);
    }
    const wasTruncated = ids.length > seqLen;
    if (wasTruncated) {
      droppedTokens += ids.length - seqLen;
      ids = ids.slice(0, seqLen);
      lab = lab.slice(0, seqLen);
    }
    const nLoss = lossTokenCount(lab);
    if (nLoss === 0) {
      dropped += 1;
      droppedTokens += ids.length;
      continue;
    }
    truncated += wasTruncated ? 1 : 0;
    examples.push({ input_ids: Int32Array.from(ids), labels: Int32Array.from(lab) });
    tokens += ids.length;
    labelTokens += nLoss;
  }

  const n = records.length;
  if (truncated) {
    warnings.push(`${truncated} of ${n} examples were longer than seq_len=${seqLen} and were ` +
      "truncated to their first seq_len tokens (the end of their answers is not trained on)");
  }
  if (dropped) {
    warnings.push(`${dropped} of ${n} records were dropped: no loss tokens left (prompt longer ` +
      `than seq_len=${seqLen}, or no assistant turn)`);
  }
  if (eosMissing) warnings.push("the tokenizer has no EOS token: answers are trained without an end marker");
  if (!examples.length) {
    throw new DataError(`${p}: all ${n} records were dropped: none has a loss token within ` +
      `seq_len=${seqLen} (prompts too long, or no assistant turns); increase seq_len or ` +
      "shorten the prompts");
  }
  const report = makeReport({
    path: p, kind, records: n, examples: examples.length, truncated, dropped, tokens,
    label_tokens: labelTokens, warnings, seq_len: seqLen, dropped_tokens: droppedTokens,
  });
  return { examples, report };
}
