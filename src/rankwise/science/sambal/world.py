"""The default synthetic world of SAMBAL: lemmas with their forms, semantic classes and selectional
restrictions (sizes and rules in docs/methods/sambal.md). Plain data, shared by :mod:`.grammar` and
:mod:`.probes`."""

from __future__ import annotations

NUMBERS = ("sg", "pl")
TENSES = ("pres", "past")
FRAMES = ("intr", "tr", "ditr", "clausal", "loc")

#: noun lemma -> (plural, semantic class); 20 agents, 15 foods, 15 places, 10 tools
NOUNS: dict[str, tuple[str, str]] = {
    **{n: (p, "animate") for n, p in [
        ("dog", "dogs"), ("cat", "cats"), ("wolf", "wolves"), ("lamb", "lambs"), ("fox", "foxes"),
        ("horse", "horses"), ("mouse", "mice"), ("bird", "birds"), ("owl", "owls"), ("otter", "otters"),
        ("farmer", "farmers"), ("baker", "bakers"), ("child", "children"), ("teacher", "teachers"),
        ("king", "kings"), ("rabbit", "rabbits"), ("goat", "goats"), ("eagle", "eagles"),
        ("hunter", "hunters"), ("tiger", "tigers")]},
    **{n: (p, "food") for n, p in [
        ("apple", "apples"), ("loaf", "loaves"), ("cake", "cakes"), ("egg", "eggs"), ("onion", "onions"),
        ("carrot", "carrots"), ("plum", "plums"), ("pear", "pears"), ("berry", "berries"),
        ("grape", "grapes"), ("cookie", "cookies"), ("pie", "pies"), ("nut", "nuts"), ("melon", "melons"),
        ("peach", "peaches")]},
    **{n: (p, "place") for n, p in [
        ("valley", "valleys"), ("forest", "forests"), ("cave", "caves"), ("river", "rivers"),
        ("island", "islands"), ("village", "villages"), ("castle", "castles"), ("garden", "gardens"),
        ("attic", "attics"), ("barn", "barns"), ("harbor", "harbors"), ("meadow", "meadows"),
        ("orchard", "orchards"), ("city", "cities"), ("tower", "towers")]},
    **{n: (p, "tool") for n, p in [
        ("key", "keys"), ("knife", "knives"), ("axe", "axes"), ("hammer", "hammers"), ("rope", "ropes"),
        ("spoon", "spoons"), ("ladder", "ladders"), ("bucket", "buckets"), ("oar", "oars"),
        ("needle", "needles")]},
}
A, F, P, T = "animate", "food", "place", "tool"
ANY = (A, F, P, T)
#: verb lemma -> (3sg, past, frame, subject classes, object classes, recipient classes)
VERBS: dict[str, tuple[str, str, str, tuple, tuple, tuple]] = {
    "run": ("runs", "ran", "intr", (A,), (), ()), "sleep": ("sleeps", "slept", "intr", (A,), (), ()),
    "sing": ("sings", "sang", "intr", (A,), (), ()), "swim": ("swims", "swam", "intr", (A,), (), ()),
    "fall": ("falls", "fell", "intr", (F, T), (), ()), "roll": ("rolls", "rolled", "intr", (F, T), (), ()),
    "rot": ("rots", "rotted", "intr", (F,), (), ()), "vanish": ("vanishes", "vanished", "intr", ANY, (), ()),
    "eat": ("eats", "ate", "tr", (A,), (F,), ()), "see": ("sees", "saw", "tr", (A,), ANY, ()),
    "chase": ("chases", "chased", "tr", (A,), (A,), ()), "carry": ("carries", "carried", "tr", (A,), (F, T), ()),
    "find": ("finds", "found", "tr", (A,), ANY, ()), "bake": ("bakes", "baked", "tr", (A,), (F,), ()),
    "sharpen": ("sharpens", "sharpened", "tr", (A,), (T,), ()), "visit": ("visits", "visited", "tr", (A,), (P,), ()),
    "fear": ("fears", "feared", "tr", (A,), (A,), ()), "clean": ("cleans", "cleaned", "tr", (A,), (T, P), ()),
    "give": ("gives", "gave", "ditr", (A,), (F, T), (A,)), "send": ("sends", "sent", "ditr", (A,), (F, T), (A,)),
    "throw": ("throws", "threw", "ditr", (A,), (F, T), (A,)), "hand": ("hands", "handed", "ditr", (A,), (F, T), (A,)),
    "think": ("thinks", "thought", "clausal", (A,), (), ()), "say": ("says", "said", "clausal", (A,), (), ()),
    "hope": ("hopes", "hoped", "clausal", (A,), (), ()), "know": ("knows", "knew", "clausal", (A,), (), ()),
    "live": ("lives", "lived", "loc", (A,), (P,), ()), "stay": ("stays", "stayed", "loc", (A,), (P,), ()),
    "hide": ("hides", "hid", "loc", (A,), (P,), ()), "rest": ("rests", "rested", "loc", (A,), (P,), ()),
}
#: adjective lemma -> the noun classes it sensibly modifies
ADJS: dict[str, tuple[str, ...]] = {
    **{a: (A,) for a in ("hungry", "sleepy", "angry", "brave", "clever")},
    **{a: (F,) for a in ("ripe", "sweet", "sour", "fresh", "salty")},
    **{a: (P,) for a in ("quiet", "distant", "empty", "ancient")},
    **{a: (T,) for a in ("sharp", "heavy", "rusty")},
    **{a: ANY for a in ("old", "small", "big")},
}
DETS = {"sg": ("the", "a", "every", "this"), "pl": ("the", "some", "two", "these")}
DET_P = {"sg": (0.6, 0.25, 0.05, 0.1), "pl": (0.6, 0.2, 0.1, 0.1)}
PREPS = ("near", "behind", "beside", "with")
ADVT = {"past": "yesterday", "pres": "now"}
