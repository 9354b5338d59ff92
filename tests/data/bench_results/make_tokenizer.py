import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for i in range(2000):
    vocab[f"w{i}"] = len(vocab)
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
fast.save_pretrained(sys.argv[1])
print(fast("w1 w2 w3")["input_ids"], repr(fast.decode([5, 6, 7])))
