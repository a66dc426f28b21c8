"""Random needle keys and values for the RULER-style tasks: words, 7-digit numbers, UUIDs, coded words.

RULER draws its word needles (adjective-noun pairs) and its common-words lists from the
``wonderwords`` package; these lists are our own (plain English words, no package), so the
draws differ but the kinds are the same. Every function takes the caller's seeded
``random.Random``: the same seed gives the same values.
"""

from __future__ import annotations

import random
import string
import uuid

ADJECTIVES = """
able acidic active adorable afraid agile alert ancient angry anxious arctic awake bitter bland blind bold
brave breezy brief bright brisk broad broken bumpy busy calm careful cheap cheerful chilly clean clever
cloudy clumsy coastal cold common cosmic crisp crooked cruel curious curly damp dark dear deep dense
distant dizzy dry dull dusty eager early earnest easy elastic elegant empty endless equal even exact faint
fair famous fancy fast fearless fierce filthy firm flat fluffy foggy fond formal fragile frank free fresh
friendly frozen full funny fuzzy gentle giant glad gloomy golden graceful grand greasy great greedy grumpy
guilty hairy handy happy hard harsh hasty healthy heavy hidden hollow honest huge humble hungry icy idle
jolly juicy keen kind large late lazy lean light little lively lonely loose loud lucky lush mellow merry
mighty mild misty modern modest moist narrow nasty neat nervous noble noisy odd old orange pale patient
plain plastic pleasant polite poor proud purple quick quiet rapid rare raw ready regal rich rigid ripe
rough round royal rude rural rusty sad safe salty sandy scarce secret shaggy sharp shiny short shy silent
silly simple sleepy slim slow small smooth snowy soft solid sour spare spicy steady steep sticky stiff
stormy strange strict strong sturdy sudden sunny super sweet swift tall tame tender thick thin thirsty
tidy tiny tired tough tropical true ugly uneven upset urban useful vague vast violet vivid warm wary weak
wealthy weary wet white whole wicked wide wild wise witty wooden young zealous
""".split()

NOUNS = """
acorn actor anchor ant apple apron arch army arrow attic aunt author autumn badge bag baker ball balloon
banana band bank barn basket bath beach bean bear beard bed bee bell belt bench berry bird blanket boat
bone book boot bottle box bread brick bridge broom brush bucket bull bush butter button cabin cable cake
camel camera camp candle canoe canyon cap car card carpet carrot castle cat cave cellar chain chair chalk
cheese cherry chest chicken chimney church circle city clock cloud coat coffee coin comet cook copper
corn cottage cotton cow crab crayon creek crown cup curtain daisy desert desk diamond dinner doctor dog
doll dolphin door dragon drawer dress drum duck eagle ear earth egg elbow engine feather fence field
finger fire fish flag flame flower flute fog forest fork fountain fox frog garden gate ghost gift
giraffe glass glove goat gold grape grass guitar hammer harbor hat hawk heart hill honey horse house
island jacket jar jelly jewel kettle key king kite kitten ladder lake lamp lantern leaf lemon letter
lion lizard lock magnet map marble market meadow melon mirror monkey moon mountain mouse mug nail needle
nest net night ocean office onion orchard otter owl oyster paint palace pan paper parrot pearl pencil
pepper piano pig pillow pirate planet plate pocket pond potato puppy queen rabbit radio rain river road
robin rocket roof rope rose sail salt sand school scarf sea seed shark sheep shell ship shoe shovel
silver sink sister sky snail snake sock soup spider spoon spring star stone storm stove street sugar
summer sun swan table teacher tent thread throne tiger tomato tooth towel tower toy train tree truck
trumpet tulip turtle umbrella valley vase village violin wagon wall walrus wand water whale wheel window
wing winter wizard wolf wool yard zebra
""".split()

VERBS = """
accept add admire agree allow answer appear argue arrive ask bake balance bang bathe battle beg behave
belong blink boast boil borrow bounce breathe brush build bump calculate call camp carry carve catch
challenge change chase cheer chew clap clean climb coach collect comb command compare complain count
cover crack crawl cross crush cry curl cycle dance decide deliver depend describe dig divide dream drift
drop dust earn enjoy enter escape examine explain fasten fetch fill float fold follow gather glow grab
greet grin guard guess hammer hang harm hover hug hunt hurry identify ignore imagine inform invent invite
jog join juggle jump kick kneel knit knock laugh launch lick lift listen march measure melt mend mix move
nod obey observe offer open order pack paddle paint park pause peel perform pinch plant play polish pour
pray preach print promise pull pump punch push quack question race rain reach relax remember repair
rescue rhyme rinse roll rush sail scatter scrub search shave shiver shrug sigh signal skate ski skip
sneeze sniff snore spark spell spill spray sprout squash squeak stamp stare steer stir stitch stretch
stroll suggest surprise swim switch tap taste tease thank tickle trace travel trot tumble twist type
unfold unlock vanish visit wait wander warn wash watch wave weigh whisper whistle wink wobble worry yawn
""".split()

#: every word once, in a fixed order: the pool of RULER's common-words task
WORD_POOL: tuple[str, ...] = tuple(dict.fromkeys(ADJECTIVES + NOUNS + VERBS))

NEEDLE_KINDS = ("words", "numbers", "uuids")


def word_key(rng: random.Random) -> str:
    """An adjective-noun pair such as ``quiet-harbor`` (RULER's word needles have this shape)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def number_value(rng: random.Random, digits: int = 7) -> str:
    """A random number of exactly ``digits`` digits (RULER's: 7)."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def uuid_value(rng: random.Random) -> str:
    """A random version-4 UUID, drawn from ``rng`` (so reproducible, unlike ``uuid.uuid4``)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def needle_value(kind: str, rng: random.Random) -> str:
    """One random key or value of ``kind``: "words", "numbers" or "uuids"."""
    if kind == "words":
        return word_key(rng)
    if kind == "numbers":
        return number_value(rng)
    if kind == "uuids":
        return uuid_value(rng)
    raise ValueError(f"unknown needle kind {kind!r}: one of {', '.join(NEEDLE_KINDS)}")


def distinct(kind: str, count: int, rng: random.Random, avoid: set[str] | None = None) -> list[str]:
    """``count`` different values of ``kind``, none of them in ``avoid``."""
    taken = set(avoid or ())
    out: list[str] = []
    while len(out) < count:
        value = needle_value(kind, rng)
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


def coded_word(rng: random.Random, length: int = 6) -> str:
    """A made-up lower-case word of ``length`` letters (RULER's frequent-words task)."""
    return "".join(rng.choices(string.ascii_lowercase, k=length))


def variable_name(rng: random.Random, length: int = 5) -> str:
    """An upper-case variable name of ``length`` letters (RULER's variable tracking)."""
    return "".join(rng.choices(string.ascii_uppercase, k=length))
