// The data source over a training file (.txt/.jsonl/.json) through the JS data pipeline (src/data/, the
// Python device side's tokenizer, records, collate and DataOrder ported): the same micro-batches, in the
// same order, as `pocketlora train`. Position = DataOrder.stateDict(), as Python's checkpoints record it.
import { TextTokenizer, collate, dataOrder, loadExamples } from './data/index.mjs';

/** tokenizerFiles: {name: text} of the bundle's tokenizer/ (TextTokenizer.fromFiles); data: the file's bytes. */
export function openTextSource({ tokenizer, dataPath, data, microBatch, seed, seqLen, groupByLength = false, log }) {
  const { examples, report } = loadExamples(dataPath, data, tokenizer, seqLen);
  log?.(report.summary());
  const order = dataOrder(examples, seed, microBatch, groupByLength);
  return {
    report,
    microBatchesPerEpoch: order.stepsPerEpoch(),
    nextMicroBatch: () => collate(order.nextBatch()[0].map((i) => examples[i]), tokenizer.padId),
    state: () => order.stateDict(),
    loadState: (s) => order.loadStateDict(s),
  };
}

export { TextTokenizer };
