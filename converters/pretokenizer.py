"""Which llama.cpp pre-tokenizer (``tokenizer.ggml.pre``) a Hugging Face BPE tokenizer needs.

Two ways, tried in order:

1. **Hash**, as llama.cpp's converter does (``get_vocab_base_pre`` in convert_hf_to_gguf.py): sha256 of
   ``str(tokenizer.encode(CHKTXT))`` looked up in llama.cpp's table (:data:`CHKHSH_TABLE`).
2. **Behaviour**, when the hash is unknown (a fine-tune added a token, a new model reused a known
   pre-tokenizer): run llama.cpp's BPE, as the runtime would with each known pre-tokenizer's regexes
   (:mod:`ggufkit.tokenizer.pretokenizers`), over the very vocabulary and merges being written, on a varied text,
   with the evaluator's own BPE driver (:class:`ggufkit.tokenizer.bpe_session.BpeSession`), and keep the
   pre-tokenizer whose ids equal the HF tokenizer's. If none does, the error names the closest
   candidates and the ``--pre-tokenizer NAME`` override.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import TokenType

from ggufkit.errors import TokenizerError
from ggufkit.tokenizer.bpe import merge_ranks

if TYPE_CHECKING:
    from ggufkit.tokenizer.bpe_session import BpeSession

__all__ = [
    "BEHAVIOUR_TEXT", "CHKHSH_TABLE", "CHKTXT", "PreTokenizerMatch", "bpe_tokenize", "chkhsh",
    "detect_pre_tokenizer", "known_pre_tokenizer",
]

#: llama.cpp's fixed check text (conversion/base.py ``chktxt``; identical to ``CHK_TXT`` in
#: convert_hf_to_gguf_update.py). 350 characters, 431 UTF-8 bytes, sha256 a36179c1...526da.
#: Written with escapes so that no editor can normalise it.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f "
    "(multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 "
    "33333333 3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6"
    "\u1785\U0001f601 ?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= "
    "\u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll "
    "make it, 'D you like some tea? We'Ve a'lL"
)
CHKTXT_SHA256 = "a36179c1e2b1cfcfbfad1dc779addad2ffc778201e4cf0d538bddeafa2c526da"

#: Text for behaviour detection: the check text plus what separates the regex families further
#: (digit groups of every length, case-mixed contractions, CR/LF runs, punctuation after spaces, accents,
#: CJK next to Latin, whitespace before letters). No control characters 0x1C-0x1F, where Python's ``\s``
#: and llama.cpp's whitespace class differ.
BEHAVIOUR_TEXT = CHKTXT + (
    "\nThe year 2024 had 365 days; 1234567890 and 3.14159, 1,000,000 and 007.\r\n\r\n"
    "DON'T, Don't, don't; WE'LL we'll I'D i'd YOU'RE you're.  Two  spaces,   three;\ttab\t\tx\n"
    "  $cost = (a+b) * c^2 <= 100 || x != y && z >= 0; // ~tilde |pipe|\n"
    "caf\u00e9 na\u00efve \u00c4pfel stra\u00dfe \u65e5\u672c\u8a9eabc\u4e2d\u6587123 \u0440\u0443\u0441\u0441\u043a\u0438\u0439\n"
    "   \n\n\n    indented line\n\n  end  "
)

# chkhsh -> tokenizer.ggml.pre, from llama.cpp conversion/base.py get_vocab_base_pre (llama-cpp-python 0.3.36
# sdist, llama.cpp 0c1e570; convert_hf_to_gguf.py: get_vocab_base_pre). Rows are in code order; the code checks them
# with a chain of `if`s, so for a repeated hash the later row wins, and dict() keeps exactly that.
_CHKHSH_ROWS: tuple[tuple[str, str], ...] = (
    ("b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b", "chatglm-bpe"),
    ("81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516", "chatglm-bpe"),
    ("a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2", "glm4"),
    ("9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902", "glm4"),
    ("cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267", "glm4"),
    ("1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35", "minerva-7b"),
    ("7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664", "hunyuan"),
    ("bba3b3366b646dbdded5dbc42d59598b849371afc42f7beafa914afaa5b70aa6", "hunyuan-dense"),
    ("e6ddf9c6686791c12d698d34c31ab9be1fea9af5a3d9a6909783ab382198ae1c", "hy_v4"),
    ("a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6", "falcon-h1"),
    ("60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86", "falcon-h1"),
    ("3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896", "falcon-h1"),
    ("48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b", "falcon-h1"),
    ("81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890", "kimi-k2"),
    ("d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c", "qwen2"),
    ("1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f", "qwen35"),
    ("66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273", "grok-2"),
    ("b3d1dd861f1d4c5c0d2569ce36baf3f90fe8a102db3de50dd71ff860d91be3df", "jina-v2-de"),
    ("0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4", "gpt-2"),
    ("9e454714343b69b99b71795c1d27a68c2a1d15dab111f4d353109f966af29da7", "lfm2"),
    ("846deafc5b0fa786186fa4ae6c7b49903cf2f1d1895bdb80b9120d60be135252", "gemma4"),
    ("0a766d034107bc736a3f2dc4968fd62e54a3570f1454443e0c5a4cc6bd7941ed", "spark2_5"),
    ("0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5", "llama-bpe"),
    ("049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754", "deepseek-llm"),
    ("347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821", "deepseek-coder"),
    ("8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed", "falcon"),
    ("0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f", "bert-bge"),
    ("9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e", "falcon3"),
    ("8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7", "bert-bge-large"),
    ("b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166", "mpt"),
    ("35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34", "starcoder"),
    ("3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454", "gpt-2"),
    ("32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3", "stablelm2"),
    ("6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff", "refact"),
    ("9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8", "command-r"),
    ("d772b220ace2baec124bed8cfafce0ead7d6c38a4b65ef11261cf9d5d62246d1", "tiny_aya"),
    ("52df12b4c8d4176e7481aab4b6e8454d1fd0a210a04a574f6d4e067d10e23c3e", "cohere2moe"),
    ("e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea", "qwen2"),
    ("b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166", "olmo"),
    ("a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e", "dbrx"),
    ("c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448", "jina-v1-en"),
    ("0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f", "jina-v2-en"),
    ("171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643", "jina-v2-es"),
    ("27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6", "jina-v2-de"),
    ("a023e9fdc5a11f034d3ef515b92350e56fb2af1f66c6b6811a4444ea9bf8763d", "jina-v5-nano"),
    ("c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d", "smaug-bpe"),
    ("c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360", "poro-chat"),
    ("7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a", "jina-v2-code"),
    ("7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee", "viking"),
    ("b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901", "jais"),
    ("bc5108ee1eb6a3d600cadd065f63190fbd0554dbc9e4bbd6a0d977970afc8d2a", "jais-2"),
    ("7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f", "codeshell"),
    ("63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e", "tekken"),
    ("855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249", "smollm"),
    ("3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7", "bloom"),
    ("bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21", "gpt3-finnish"),
    ("4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae", "exaone"),
    ("fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085", "phi-2"),
    ("60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450", "chameleon"),
    ("8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65", "roberta-bpe"),
    ("ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb", "gigachat"),
    ("d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1", "megrez"),
    ("877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5", "deepseek-v3"),
    ("b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5", "deepseek-r1-qwen"),
    ("ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e", "gpt-4o"),
    ("7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f", "superbpe"),
    ("1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15", "trillion"),
    ("96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224", "bailingmoe"),
    ("d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406", "llama4"),
    ("0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3", "pixtral"),
    ("d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec", "seed-coder"),
    ("b0a6b1c0bd5998ebd9df08611efde34a4ff03faed45ae09c43e6b31ebd4b94cf", "a.x-4.0"),
    ("f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4", "midm-2.0"),
    ("169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51", "lfm2"),
    ("2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb", "exaone4"),
    ("a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756", "mellum"),
    ("a0b64b4385f123663873756336c085744376d015ff328bb1d901598f63c44152", "modern-bert"),
    ("49fc0303c9e0d2c2c565c510f64b2d9b271276acdcdadff733249eda9f7d59df", "afmoe"),
    ("9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206", "bailingmoe2"),
    ("53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e", "granite-docling"),
    ("f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95", "minimax-m2"),
    ("4a2e2abae11ca2b86d570fc5b44be4d5eb5e72cc8f22dd136a94b37da83ab665", "kormo"),
    ("9d70134b369a70e5735009b6de918f7581b5211f7c074d1f89f753aea8248af1", "youtu"),
    ("16389f0a1f51ee53e562ffd51c371dc508639ab0e4261502071836e50e223e91", "solar-open"),
    ("6c81ce329e0802883b22eabab0d3fa48357337ef1ecb45443828bf1f6254833f", "exaone-moe"),
    ("d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4", "qwen35"),
    ("b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d", "joyai-llm"),
    ("e4d54df1ebc1f2b91acd986c5b51aa50837d5faf7c7398e73c1f9e9ee5d19869", "kanana2"),
    ("862f827721df956049dff5ca81a57f29e575280bc622e290d3bf4e35eca29015", "f2llmv2"),
    ("62f6fb0a6fd5098caeabb19b07a5c1099cafc8b9c40eab6ea89ece4ec02fbc57", "sarvam-moe"),
    ("f728162c1315c26e40249849799b4ba3fe584c32084b4795b03eb295e63cb5af", "talkie"),
    ("36f3066e97b7f3994b379aaacde306c1444c6ae84e81a5ae3cd2b7ed3b8c42d4", "minicpm5"),
    ("f241072145675bf8322086f115aebad05e9f869557a238bf2150a2a417d1bf60", "granite-embed-multi-97m"),
    ("789696f5946cc0fc59371f39f6097cafed196b3acded6140432f26bbb1ae1669", "granite-embed-multi-311m"),
    ("9dcf830ee9990cdbf78cc523a5f7bd9ad8f3f9890c2d3581d2785ad10f07049d", "mellum2"),
    ("972da7b59cec44d1f0a490a86c96df53859e486e481563e5dddac155013d87ac", "laguna"),
    ("653660222fb704f61cbf2b618a8ae6502b7f8b20c980f9a5de07ed78e13319cd", "ufakzeka"),
)
CHKHSH_TABLE: dict[str, str] = dict(_CHKHSH_ROWS)

#: When several names reproduce a tokenizer (several names share one regex), the first of these wins: the
#: canonical name of each regex family (llama-bpe, not dbrx or smaug-bpe, which reuse Llama 3's rules).
_PREFERRED = ("llama-bpe", "qwen2", "gpt-2", "smollm", "deepseek-llm", "deepseek-coder", "falcon", "default")


@dataclass(frozen=True)
class PreTokenizerMatch:
    """The chosen ``tokenizer.ggml.pre`` and how it was chosen.

    Attributes:
        name: the pre-tokenizer name written to the file.
        method: ``"hash"`` (llama.cpp's table), ``"behaviour"`` or ``"override"``.
        chkhsh: llama.cpp's check hash of this tokenizer.
        agreeing: with ``"behaviour"``, every known name whose rules reproduced the tokenizer.
        note: with ``"behaviour"`` and several agreeing names, which one was chosen and why.
    """

    name: str
    method: str
    chkhsh: str
    agreeing: tuple[str, ...] = field(default=())
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "method": self.method, "chkhsh": self.chkhsh, "note": self.note or None}


def chkhsh(encode: Callable[[str], Sequence[int]]) -> str:
    """llama.cpp's check hash: sha256 of ``str(list_of_ids)`` of :data:`CHKTXT` encoded with special tokens.

    Args:
        encode: the HF tokenizer's ``encode`` (with its default ``add_special_tokens=True``).
    """
    return hashlib.sha256(str(list(encode(CHKTXT))).encode()).hexdigest()


def known_pre_tokenizer(name: str) -> str:
    """Validate a ``--pre-tokenizer`` name: one llama.cpp's runtime accepts.

    Those are the names of :mod:`ggufkit.tokenizer.pretokenizers` plus every name of llama.cpp's hash table (a few
    of which ggufkit's evaluator cannot run, but llama.cpp can).

    Raises:
        TokenizerError: an unknown name (llama.cpp refuses to load a file with one).
    """
    from ggufkit.tokenizer.pretokenizers import PRE_TOKENIZERS

    names = set(PRE_TOKENIZERS) | set(CHKHSH_TABLE.values())
    if name not in names:
        raise TokenizerError(f"unknown pre-tokenizer {name!r}; known: {', '.join(sorted(names))}")
    return name


def _fragments(text: str, user_defined: Sequence[str]) -> list[tuple[str, bool]]:
    """Cut user-defined tokens out of raw text, longest first: (fragment, is_token) pairs.

    llama.cpp's partition (:func:`ggufkit.tokenizer.gguf_tokenizer.partition`); this check has always ranked
    the tokens by length in characters (llama.cpp: in UTF-8 bytes), which can differ only for tokens with
    non-ASCII text that overlap in the text.
    """
    from ggufkit.tokenizer.gguf_tokenizer import partition

    order = sorted(user_defined, key=len, reverse=True)
    return [(order[p], True) if isinstance(p, int) else (p, False)
            for p in partition(text, ((k, t, 0) for k, t in enumerate(order)))]


def _session(name: str, token_to_id: dict[str, int], ranks: dict[tuple[str, str], int]) -> BpeSession:
    """llama.cpp's BPE session for pre-tokenizer ``name`` over the vocabulary being written.

    The session is the evaluator's (llm_tokenizer_bpe_session::tokenize), missing symbols included: the
    question here is whether llama.cpp's runtime, given this name, reproduces the HF tokenizer's ids, so the
    runtime's rules are the ones to simulate, not HF's. Every candidate runs byte-level, as this check always
    has (vocab.py refuses the byte_fallback tokenizers that are not), including the raw-UTF-8 rules of
    ``gemma4``, ``granite-embed-multi-311m`` and ``sarvam-moe``; ggufkit's own merge loop, because a
    ``tokenizers`` model per candidate would cost a second each on a large vocabulary.
    """
    from ggufkit.tokenizer.bpe_session import BpeSession
    from ggufkit.tokenizer.pretokenizers import get_pre_tokenizer

    return BpeSession(token_to_id, ranks, replace(get_pre_tokenizer(name), byte_level=True), engine="python")


def _runtime_words(text: str, session: BpeSession, user_defined: Sequence[str]) -> list[str]:
    """The byte-level words llama.cpp's BPE merges within (user-defined tokens as themselves)."""
    words: list[str] = []
    for frag, is_tok in _fragments(text, user_defined):
        words.extend([frag] if is_tok else session.words(frag))
    return words


def _runtime_ids(text: str, session: BpeSession, token_to_id: dict[str, int],
                 user_defined: Sequence[str]) -> list[int]:
    ids: list[int] = []
    for frag, is_tok in _fragments(text, user_defined):
        ids.extend([token_to_id[frag]] if is_tok else session.encode(frag))
    return ids


def bpe_tokenize(text: str, name: str, *, token_to_id: dict[str, int], ranks: dict[tuple[str, str], int],
                 user_defined: Sequence[str] = ()) -> list[int]:
    """Token ids llama.cpp's BPE tokenizer gives ``text`` with pre-tokenizer ``name`` (no BOS/EOS).

    Follows src/llama-vocab.cpp (llama_vocab::impl::load, tokenizer_st_partition): user-defined tokens
    are cut out of the raw text first (longest first), and each remaining fragment goes through llama.cpp's
    BPE session (:class:`ggufkit.tokenizer.bpe_session.BpeSession`): split by the pre-tokenizer's regexes,
    byte-level encoded, merged by lowest merge rank (leftmost on ties); a final symbol missing from the
    vocabulary is looked up byte by byte, so only its ASCII bytes can survive, as in the runtime.

    Args:
        text: raw text.
        name: a ``tokenizer.ggml.pre`` value known to :mod:`ggufkit.tokenizer.pretokenizers`.
        token_to_id: token text -> id of the vocabulary.
        ranks: merge pair -> rank.
        user_defined: texts of USER_DEFINED tokens.

    Returns:
        The token ids.

    Raises:
        TokenizerError: ``name`` is not a pre-tokenizer ggufkit can run.
    """
    return _runtime_ids(text, _session(name, token_to_id, ranks), token_to_id, user_defined)


def _hf_words(tokenizer: Any, text: str, user_defined: Sequence[str]) -> list[str] | None:
    """The HF fast tokenizer's byte-level words (normalizer, then pre-tokenizer), or None if not exposed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None:
        return None
    norm = getattr(backend, "normalizer", None)
    words: list[str] = []
    for frag, is_tok in _fragments(text, user_defined):
        if is_tok:
            words.append(frag)
            continue
        normalized = norm.normalize_str(frag) if norm is not None else frag
        words.extend(w for w, _ in pre.pre_tokenize_str(normalized))
    return words


def _hf_ignore_merges(tokenizer: Any) -> bool | None:
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    flag = getattr(model, "ignore_merges", None)
    return flag if isinstance(flag, bool) else None


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _choose(agreeing: list[tuple[bool, str]], digest: str) -> PreTokenizerMatch:
    """The canonical name among those whose rules reproduced the tokenizer.

    Args:
        agreeing: (whether the name's ignore_merges flag is the HF model's, name), in table order.
    """
    from ggufkit.tokenizer.pretokenizers import PRE_TOKENIZERS

    rank = {n: i for i, n in enumerate(_PREFERRED)}
    # Different regexes: the name with the HF model's ignore_merges flag, then the common names.
    first = min(agreeing, key=lambda x: (not x[0], rank.get(x[1], len(rank))))[1]
    # Identical regexes (Llama 3's rules are also dbrx's, smaug-bpe's, chatglm's): the family's canonical
    # name, whatever its flag - on the check text its ids equal the tokenizer's, or it would not be here.
    regexes = PRE_TOKENIZERS[first].regexes
    same = [x for x in agreeing if PRE_TOKENIZERS[x[1]].regexes == regexes]
    best = min(same, key=lambda x: (rank.get(x[1], len(rank)), not x[0]))[1]
    names = tuple(n for _, n in agreeing)
    note = ""
    if len(same) > 1:
        # aliases of one llama.cpp type are the same thing; name the other types that were passed over
        kind = PRE_TOKENIZERS[best].kind
        others = [n for _, n in same if PRE_TOKENIZERS[n].kind != kind] or [n for _, n in same if n != best]
        shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        note = (f"{len(same)} names reproduce this tokenizer with identical regexes; chose the canonical "
                f"{best!r} over {shown}")
    return PreTokenizerMatch(best, "behaviour", digest, names, note)


def detect_pre_tokenizer(tokenizer: Any, *, tokens: Sequence[str], token_types: Sequence[int],
                         merges: Sequence[str], override: str | None = None,
                         model_dir: Path | None = None) -> PreTokenizerMatch:
    """Choose ``tokenizer.ggml.pre`` for a HF BPE tokenizer: override, else hash, else behaviour.

    Args:
        tokenizer: a transformers tokenizer (``encode(text, add_special_tokens=...)``).
        tokens: the token texts being written (``tokenizer.ggml.tokens``).
        token_types: their types (``tokenizer.ggml.token_type``).
        merges: the merges being written (``tokenizer.ggml.merges``).
        override: a name to use as is (validated against the known names).
        model_dir: for error messages.

    Returns:
        The match: name, method, the tokenizer's chkhsh, and for behaviour the names that agreed.

    Raises:
        TokenizerError: unknown hash and no known pre-tokenizer reproduces the tokenizer (the message
            names the closest candidates and ``--pre-tokenizer NAME``), or an unknown override.
    """
    from ggufkit.tokenizer.pretokenizers import PRE_TOKENIZERS

    digest = chkhsh(tokenizer.encode)
    if override is not None:
        return PreTokenizerMatch(known_pre_tokenizer(override), "override", digest)
    if digest in CHKHSH_TABLE:
        return PreTokenizerMatch(CHKHSH_TABLE[digest], "hash", digest)

    expected = list(tokenizer.encode(BEHAVIOUR_TEXT, add_special_tokens=False))
    token_to_id = {t: i for i, t in enumerate(tokens)}
    user_defined = [t for t, ty in zip(tokens, token_types) if ty == TokenType.USER_DEFINED]
    ranks = merge_ranks(merges)
    # Ids alone cannot tell regexes apart when a vocabulary has few merges (one-byte tokens split alike
    # however the words are cut), so the HF pre-tokenizer's words must agree as well where it exposes them.
    hf_words = _hf_words(tokenizer, BEHAVIOUR_TEXT, user_defined)
    hf_ignore_merges = _hf_ignore_merges(tokenizer)
    # Names sharing regexes and flags behave identically: run each distinct rule once.
    groups: dict[tuple[tuple[str, ...], bool], list[str]] = {}
    for name, rule in PRE_TOKENIZERS.items():
        groups.setdefault((rule.regexes, rule.ignore_merges), []).append(name)
    agreeing: list[tuple[bool, str]] = []
    near: list[tuple[int, str]] = []
    for (_, ignore_merges), names in groups.items():
        label = next((n for n in _PREFERRED if n in names), names[0])
        words_agree = 0
        session = _session(names[0], token_to_id, ranks)
        if hf_words is not None:
            words = _runtime_words(BEHAVIOUR_TEXT, session, user_defined)
            words_agree = _first_difference(words, hf_words)
            if words != hf_words:
                near.append((words_agree, label))
                continue
        got = _runtime_ids(BEHAVIOUR_TEXT, session, token_to_id, user_defined)
        if got != expected:
            near.append((_first_difference(got, expected), label))
            continue
        agreeing.extend((ignore_merges == hf_ignore_merges, n) for n in names)
    if agreeing:
        return _choose(agreeing, digest)
    unit = "pre-tokenized words" if hf_words is not None else "tokens"
    near.sort(key=lambda x: (-x[0], x[1]))
    closest = ", ".join(f"{n} (first {k} {unit} agree)" for k, n in near[:3])
    raise TokenizerError(
        f"BPE pre-tokenizer not recognised: chkhsh {digest} is not in llama.cpp's table and no known "
        f"pre-tokenizer reproduces this tokenizer; closest: {closest or 'none'}. If one of them is right, "
        "pass --pre-tokenizer NAME", path=model_dir)
