// The bundle's tokenizer on the device, in JS: the same ids, special tokens and chat-template
// rendering as ort_trainer/data.py's TextTokenizer (Python, HF `tokenizers` + jinja2).
//
// * Encoding: @huggingface/tokenizers (pure JS port of HF tokenizers) over the bundle's
//   tokenizer.json. As in Python, tokenizer.json alone decides the ids (its post-processor decides
//   which special tokens add_special_tokens=true adds); tokenizer_config.json only supplies the
//   special-token strings and the chat template.
// * Chat templates: @huggingface/jinja (trim_blocks/lstrip_blocks, raise_exception, tojson,
//   strftime_now, the {% generation %} tag), rendered with the variables HF apply_chat_template
//   passes: messages, add_generation_prompt, tools=None, documents=None, bos/eos/unk/pad_token
//   (left undefined when absent), additional_special_tokens.
// * Template source order: chat_template.jinja, else tokenizer_config.json "chat_template" (a string
//   or the [{name, template}] list's "default"), else chat_template.json; none -> PLAIN_CHAT_TEMPLATE.

import { Tokenizer } from "@huggingface/tokenizers";
import { Environment, Interpreter, Template } from "@huggingface/jinja";
import { DataError } from "./errors.mjs";
import { strRepr } from "./pystr.mjs";

/** The chat format used when the tokenizer has no chat template (same text as data.py's). */
export const PLAIN_CHAT_TEMPLATE =
  "{%- for message in messages -%}" +
  "{%- if not loop.first %}{{ '\\n' }}{% endif -%}" +
  "{%- if message['role'] == 'system' -%}{{ 'System: ' + message['content'] }}" +
  "{%- elif message['role'] == 'user' -%}{{ 'User: ' + message['content'] }}" +
  "{%- elif message['role'] == 'assistant' -%}" +
  "{{ 'Assistant: ' + message['content'] }}{% if eos_token is defined %}{{ eos_token }}{% endif %}" +
  "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}" +
  "{%- endif -%}" +
  "{%- endfor -%}" +
  "{%- if add_generation_prompt -%}{% if messages %}{{ '\\n' }}{% endif %}{{ 'Assistant:' }}{%- endif -%}";

/** A chat template failed to render (Python: jinja2.TemplateError). */
export class TemplateError extends Error {
  constructor(message) {
    super(message);
    this.name = "TemplateError";
  }
}

// -- jinja2 semantics on top of @huggingface/jinja ------------------------------------------------
// jinja2's default Undefined renders as "" but raises UndefinedError on attribute/item access, so
// e.g. Qwen's and Gemma's templates fail on an empty conversation ("list object has no element 0"),
// which makes a chat whose first turn is the assistant's a DataError in Python. @huggingface/jinja
// returns undefined there; this interpreter raises jinja2's message instead.

const PY_TYPE = { ArrayValue: "list", ObjectValue: "dict", StringValue: "str", IntegerValue: "int",
  FloatValue: "float", BooleanValue: "bool", NullValue: "NoneType", NamespaceValue: "Namespace",
  FunctionValue: "function" };

function objectTypeRepr(v) {
  if (v.type === "NullValue") return "None";
  return `${PY_TYPE[v.type] ?? v.type} object`;
}

function undefinedMessage(undef, node) {
  if (undef._jinjaObj !== undefined) {
    const name = undef._jinjaName;
    if (typeof name !== "string") return `${objectTypeRepr(undef._jinjaObj)} has no element ${name}`;
    return `${strRepr(objectTypeRepr(undef._jinjaObj))} has no attribute ${strRepr(name)}`;
  }
  if (node && node.type === "Identifier") return `${strRepr(node.value)} is undefined`;
  return "undefined value";
}

class Jinja2Interpreter extends Interpreter {
  evaluate(node, env) {
    if (this._pre !== undefined && this._pre[0] === node) {
      const v = this._pre[1];
      this._pre = undefined;
      return v;
    }
    return super.evaluate(node, env);
  }

  evaluateMemberExpression(expr, env) {
    const object = this.evaluate(expr.object, env);
    if (object.type === "UndefinedValue") throw new TemplateError(undefinedMessage(object, expr.object));
    this._pre = [expr.object, object];
    const value = super.evaluateMemberExpression(expr, env);
    this._pre = undefined;
    if (value.type === "UndefinedValue" && value._jinjaObj === undefined) {
      let name;
      if (!expr.computed) name = expr.property.value;
      else {
        const prop = this.evaluate(expr.property, env);
        name = prop.type === "IntegerValue" ? prop.value : prop.type === "StringValue" ? prop.value : String(prop.value);
      }
      value._jinjaObj = object;
      value._jinjaName = name;
    }
    return value;
  }
}

const pad2 = (n) => String(n).padStart(2, "0");
const MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
  "November", "December"];
const DAYS = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/** Python datetime.now().strftime(fmt) for the usual directives (C locale). */
function strftimeNow(fmt) {
  const d = new Date();
  const start = new Date(d.getFullYear(), 0, 1);
  const yday = Math.floor((d - start) / 86400000) + 1;
  const map = {
    Y: String(d.getFullYear()), y: pad2(d.getFullYear() % 100), m: pad2(d.getMonth() + 1), d: pad2(d.getDate()),
    H: pad2(d.getHours()), I: pad2(((d.getHours() + 11) % 12) + 1), M: pad2(d.getMinutes()), S: pad2(d.getSeconds()),
    p: d.getHours() < 12 ? "AM" : "PM", b: MONTHS[d.getMonth()].slice(0, 3), B: MONTHS[d.getMonth()],
    a: DAYS[d.getDay()].slice(0, 3), A: DAYS[d.getDay()], j: String(yday).padStart(3, "0"), "%": "%",
  };
  return fmt.replace(/%(.)/g, (m, c) => map[c] ?? m);
}

function pyRange(start, stop, step = 1) {
  if (stop === undefined) {
    stop = start;
    start = 0;
  }
  if (step === 0) throw new TemplateError("range() arg 3 must not be zero");
  const out = [];
  for (let i = start; step > 0 ? i < stop : i > stop; i += step) out.push(i);
  return out;
}

/** A compiled chat template rendered with jinja2 semantics (see above). */
class ChatTemplate {
  constructor(source) {
    this.template = new Template(source);
  }

  render(items) {
    const env = new Environment();
    for (const [k, v] of Object.entries({ false: false, true: true, none: null, False: false, True: true, None: null })) {
      env.set(k, v);
    }
    env.set("raise_exception", (message) => {
      throw new TemplateError(message);
    });
    env.set("range", pyRange);
    env.set("strftime_now", strftimeNow);
    for (const [k, v] of Object.entries(items)) env.set(k, v);
    return new Jinja2Interpreter(env).run(this.template.parsed).value;
  }
}

/** A special token from tokenizer_config.json: a string or an AddedToken dict with "content". */
function tokenStr(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === "string") return value;
  if (typeof value === "object" && typeof value.content === "string") return value.content;
  return null;
}

function pickTemplate(value) {
  if (typeof value === "string") return value;
  if (Array.isArray(value)) {
    const named = {};
    for (const t of value) if (t && typeof t === "object" && !Array.isArray(t)) named[t.name] = t.template;
    return typeof named.default === "string" ? named.default : null;
  }
  return null;
}

function readJson(files, name, dir) {
  const v = files[name];
  let data = v;
  if (typeof v === "string" || v instanceof Uint8Array || v instanceof ArrayBuffer) {
    try {
      const text = typeof v === "string" ? v : new TextDecoder("utf-8", { fatal: true }).decode(v);
      data = JSON.parse(text);
    } catch (e) {
      throw new DataError(`${dir}/${name}: cannot read (${e.message}); rebuild the bundle's tokenizer directory`);
    }
  }
  if (data === null || typeof data !== "object" || Array.isArray(data)) {
    throw new DataError(`${dir}/${name}: expected a JSON object; rebuild the bundle's tokenizer directory`);
  }
  return data;
}

function readText(v) {
  return typeof v === "string" ? v : new TextDecoder("utf-8").decode(v);
}

const CLEANUP = [[" .", "."], [" ?", "?"], [" !", "!"], [" ,", ","], [" ' ", "'"], [" n't", "n't"],
  [" 'm", "'m"], [" 's", "'s"], [" 've", "'ve"], [" 're", "'re"]];

/** Files of a bundle's tokenizer/ directory the device reads (all but tokenizer.json optional). */
export const TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
  "chat_template.jinja", "chat_template.json"];

export class TextTokenizer {
  /**
   * Build from the tokenizer directory's files: `files` maps file name -> contents (a string, bytes,
   * or an already parsed object for the JSON files). `dir` only names the directory in messages.
   */
  static fromFiles(files, { dir = "tokenizer" } = {}) {
    if (files["tokenizer.json"] === undefined) {
      throw new DataError(`${dir}/tokenizer.json: not found; the bundle's tokenizer directory needs tokenizer.json ` +
        "(written by HF save_pretrained of a fast tokenizer); rebuild the bundle");
    }
    const tj = readJson(files, "tokenizer.json", dir);
    const cfg = files["tokenizer_config.json"] !== undefined ? readJson(files, "tokenizer_config.json", dir) : {};
    const stm = files["special_tokens_map.json"] !== undefined ? readJson(files, "special_tokens_map.json", dir) : {};
    const special = (name) => {
      const v = tokenStr(cfg[name]);
      return v !== null ? v : tokenStr(stm[name]);
    };
    const bos = special("bos_token");
    const eos = special("eos_token");
    const pad = special("pad_token");
    const unk = special("unk_token");
    const extraRaw = cfg.additional_special_tokens !== undefined ? cfg.additional_special_tokens
      : stm.additional_special_tokens;
    const extra = (Array.isArray(extraRaw) ? extraRaw : []).map(tokenStr).filter((t) => t !== null);

    let tok;
    try {
      // Python's tokenizers.Tokenizer ignores tokenizer_config.json; give the JS port only what cannot
      // change encoding (no remove_space / lowercase flags), and decode cleanup is applied below.
      tok = new Tokenizer(tj, { eos_token: eos ?? undefined, clean_up_tokenization_spaces: false });
    } catch (e) {
      throw new DataError(`${dir}/tokenizer.json: cannot load (${e.message}); rebuild the bundle with a matching tokenizers version`);
    }

    let template = null;
    if (files["chat_template.jinja"] !== undefined) template = readText(files["chat_template.jinja"]);
    if (template === null) template = pickTemplate(cfg.chat_template);
    if (template === null && files["chat_template.json"] !== undefined) {
      template = pickTemplate(readJson(files, "chat_template.json", dir).chat_template);
    }

    return new TextTokenizer({
      tok, bosToken: bos, eosToken: eos, padToken: pad, unkToken: unk, additionalSpecialTokens: extra,
      chatTemplate: template, cleanUpTokenizationSpaces: Boolean(cfg.clean_up_tokenization_spaces ?? false),
    });
  }

  /** Node only: read a tokenizer directory from disk. */
  static async fromDir(dir) {
    const fs = await import("node:fs/promises");
    const path = await import("node:path");
    const files = {};
    for (const name of TOKENIZER_FILES) {
      try {
        files[name] = await fs.readFile(path.join(dir, name), "utf8");
      } catch (e) {
        if (e.code !== "ENOENT") throw e;
      }
    }
    return TextTokenizer.fromFiles(files, { dir });
  }

  constructor({ tok, bosToken = null, eosToken = null, padToken = null, unkToken = null,
    additionalSpecialTokens = [], chatTemplate = null, cleanUpTokenizationSpaces = false }) {
    this.tok = tok;
    this.bosToken = bosToken;
    this.eosToken = eosToken;
    this.padToken = padToken;
    this.unkToken = unkToken;
    this.additionalSpecialTokens = [...additionalSpecialTokens];
    this.chatTemplate = chatTemplate;
    this.cleanUpTokenizationSpaces = cleanUpTokenizationSpaces;
    this.bosId = this.tokenToId(bosToken);
    this.eosId = this.tokenToId(eosToken);
    const padId = this.tokenToId(padToken);
    /** pad_token's id, else eos_id, else 0 */
    this.padId = padId !== null ? padId : this.eosId !== null ? this.eosId : 0;
    this._affixes = null;
    this._compiled = null;
  }

  tokenToId(token) {
    if (token === null || token === undefined) return null;
    const id = this.tok.token_to_id(token);
    return id === undefined ? null : id;
  }

  // -- encoding -------------------------------------------------------------------------

  /** Token ids of text (array of numbers). */
  encode(text, addSpecialTokens = true) {
    return this.tok.encode(text, { add_special_tokens: addSpecialTokens }).ids;
  }

  encodeBatch(texts, addSpecialTokens = true) {
    return texts.map((t) => this.encode(t, addSpecialTokens));
  }

  decode(ids, skipSpecialTokens = false) {
    const list = Array.from(ids, Number);
    let text = list.length ? this.tok.decode(list, { skip_special_tokens: skipSpecialTokens, clean_up_tokenization_spaces: false }) : "";
    if (this.cleanUpTokenizationSpaces) for (const [a, b] of CLEANUP) text = text.replaceAll(a, b);
    return text;
  }

  _specialAffixes() {
    if (this._affixes === null) {
      const plain = this.encode("a", false);
      const full = this.encode("a", true);
      this._affixes = [[], []];
      for (let k = 0; k + plain.length <= full.length; k++) {
        if (plain.every((v, i) => full[k + i] === v)) {
          this._affixes = [full.slice(0, k), full.slice(k + plain.length)];
          break;
        }
      }
    }
    return this._affixes;
  }

  /** Special tokens the post-processor puts before a single sequence (e.g. Gemma's <bos>). */
  get prefixIds() {
    return [...this._specialAffixes()[0]];
  }

  /** Special tokens the post-processor puts after a single sequence (usually none). */
  get suffixIds() {
    return [...this._specialAffixes()[1]];
  }

  // -- chat -----------------------------------------------------------------------------

  get hasChatTemplate() {
    return Boolean(this.chatTemplate);
  }

  _template() {
    if (this._compiled === null) this._compiled = new ChatTemplate(this.chatTemplate || PLAIN_CHAT_TEMPLATE);
    return this._compiled;
  }

  /** The special-token variables HF passes to chat templates (absent ones are left undefined). */
  templateVariables() {
    const out = {};
    for (const [name, v] of [["bos_token", this.bosToken], ["eos_token", this.eosToken],
      ["unk_token", this.unkToken], ["pad_token", this.padToken]]) {
      if (v !== null) out[name] = v;
    }
    out.additional_special_tokens = [...this.additionalSpecialTokens];
    return out;
  }

  /**
   * Render messages like HF apply_chat_template(..., tokenize=False), with the tokenizer's chat
   * template or PLAIN_CHAT_TEMPLATE. Tokenize the result with addSpecialTokens=false (plus
   * prefixIds in front when there is no chat template). Failures throw TemplateError.
   */
  renderChat(messages, addGenerationPrompt = false, templateKwargs = {}) {
    const vars = { tools: null, documents: null, ...this.templateVariables(), ...templateKwargs,
      messages, add_generation_prompt: addGenerationPrompt };
    try {
      return this._template().render(vars);
    } catch (e) {
      throw new TemplateError(e && e.message !== undefined ? e.message : String(e));
    }
  }

  /** The ids training puts before an assistant's answer to `messages` (ending with a user turn). */
  generationPromptIds(messages) {
    const text = this.renderChat(messages, true);
    const prefix = this.hasChatTemplate ? [] : this.prefixIds;
    return [...prefix, ...this.encode(text, false)];
  }
}
