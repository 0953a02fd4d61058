// A data source over micro-batches tokenized and ordered elsewhere (the workstation's Python data pipeline),
// until the JS tokenizer/batching modules (src/data/) land. File format (JSON):
//   {"format": "pocketlora-microbatches/1", "micro_batch": B, "micro_batches_per_epoch": K,
//    "micro_batches": [{"input_ids": [[...]], "attention_mask": [[...]], "labels": [[...]]}, ...]}
// micro_batches are in training order (as DataOrder + collate produce them, epochs one after another);
// the position is the index of the next one.
import { makeBatch } from './engine.mjs';

export const FORMAT = 'pocketlora-microbatches/1';

export class PretokenizedSource {
  constructor(doc, { microBatch } = {}) {
    if (doc.format !== FORMAT) throw new Error(`pre-tokenized data: format ${doc.format}, expected ${FORMAT}`);
    if (microBatch !== undefined && doc.micro_batch !== microBatch) {
      throw new Error(`pre-tokenized data was batched with micro_batch=${doc.micro_batch}, not --micro-batch ${microBatch}`);
    }
    this.batches = doc.micro_batches;
    this.microBatchesPerEpoch = doc.micro_batches_per_epoch;
    this.index = 0;
  }

  nextMicroBatch() {
    if (this.index >= this.batches.length) {
      throw new Error(`pre-tokenized data holds ${this.batches.length} micro-batches; the run needs more`);
    }
    return makeBatch(this.batches[this.index++]);
  }

  state() { return { index: this.index }; }

  loadState(s) { this.index = s.index; }
}
