"""Synthetic multi-user documents with a topic label, for the text models (`madp generate --task text`).

Each record is a short email-like text: a greeting, words drawn from its topic's vocabulary, from
other topics and from common words, then one signature per user of the record. A user's
signature holds two words only that user writes (a made-up name and a catchphrase), so what a
model memorizes of a user can be measured by whether it has learned those words.
"""

from __future__ import annotations

import numpy as np

from madp.core.hashing import hash_ids

TOPICS = {
    "business": "market shares profit revenue quarter investor merger budget invoice client contract sales "
    "forecast pricing supplier stock dividend growth earnings audit payroll deal board strategy",
    "science": "experiment hypothesis data molecule protein theory telescope lab sample genome physics "
    "chemistry measurement neuron cell particle climate research model equation dataset results microscope biology",
    "sports": "match goal team coach season league score player tournament stadium training champion "
    "referee striker defense keeper fans final race medal sprint inning pitch transfer",
    "travel": "flight hotel passport luggage beach itinerary airport museum tour booking train visa "
    "island mountain hostel cruise ticket guide map resort backpack sightseeing cabin journey",
}
COMMON = (
    "the a and to of in for on with at by from about this that it we you they is are was will be "
    "have has can please let me know thanks just also some more next week today meeting update note"
).split()
_SYLLABLES = "ka ve ri zo lu ma ne ti po sa do fe gi ho ju ky la mo nu pe qi ro su ta ur vi wo xa ye za bo den".split()
TOPIC_WORD = 0.12  # chance a body word comes from the record's topic
OTHER_TOPIC_WORD = 0.04  # chance it comes from another topic
MEAN_BODY_WORDS = 30
PERSONAL_WORDS_STREAM = 7


def personal_words(users: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each user's made-up name and catchphrase: four syllables each, from a seeded hash of its id."""
    bits = hash_ids(np.asarray(users, dtype=np.int64), seed, purpose=PERSONAL_WORDS_STREAM)
    syllables = np.array(_SYLLABLES)
    parts = [syllables[(bits >> np.uint64(5 * k)) & np.uint64(31)] for k in range(8)]
    name = np.char.capitalize(np.char.add(np.char.add(parts[0], parts[1]), np.char.add(parts[2], parts[3])))
    phrase = np.char.add(np.char.add(parts[4], parts[5]), np.char.add(parts[6], parts[7]))
    return name.astype(object), phrase.astype(object)


def documents(
    offsets: np.ndarray, users: np.ndarray, seed: int, part: tuple[int, ...] = ()
) -> tuple[list[str], np.ndarray]:
    """(text, topic) of every record whose users are users[offsets[i]:offsets[i + 1]]; `part` names the
    stream of a part of a draw made part by part."""
    rng = np.random.default_rng([seed, 3, *part])
    topics = np.array(list(TOPICS), dtype=object)
    topic_words = np.array([words.split() for words in TOPICS.values()], dtype=object)
    records = len(offsets) - 1
    topic = rng.integers(0, len(topics), records)
    lengths = 5 + rng.poisson(MEAN_BODY_WORDS - 5, records)
    record_of_word = np.repeat(np.arange(records), lengths)
    draw = rng.random(len(record_of_word))
    source = np.where(draw < TOPIC_WORD, topic[record_of_word], rng.integers(0, len(topics), len(draw)))
    words = np.where(
        draw < TOPIC_WORD + OTHER_TOPIC_WORD,
        topic_words[source, rng.integers(0, topic_words.shape[1], len(draw))],
        np.array(COMMON, dtype=object)[rng.integers(0, len(COMMON), len(draw))],
    )
    names, phrases = personal_words(users, seed)
    signatures = "-- " + names + ", " + phrases
    bodies = np.split(words, np.cumsum(lengths)[:-1])
    texts = []
    for record, body in enumerate(bodies):
        lo, hi = offsets[record], offsets[record + 1]
        greeting = f"Hi {names[hi - 1]}," if hi - lo > 1 else "Hi all,"
        texts.append(" ".join([greeting, *body, *signatures[lo:hi]]))
    return texts, topics[topic]
