"""Word lists of the synthetic tasks, and RULER's depth grid."""

# --------------------------------------------------------------------------------------------
# Vocabularies. Chosen so that no value word is a substring of another value, of a key word or
# of a common English word (checked against the Paul Graham essays), and, for the default
# SmolLM2 tokenizer, each value is a single token after a space.
# --------------------------------------------------------------------------------------------

VALUE_WORDS: tuple[str, ...] = tuple(
    """
    tiger zebra giraffe elephant monkey rabbit turtle dolphin whale shark penguin falcon parrot goose
    duck pigeon deer moose camel donkey horse pony chicken frog snake lizard spider butterfly squirrel
    beaver kangaroo panda rhino leopard gorilla crab lobster octopus salmon trout oyster bison buffalo
    alligator crocodile tortoise jellyfish mosquito orange yellow blue purple violet pink grey silver
    golden scarlet navy turquoise ivory lavender indigo olive London Berlin Madrid Vienna Prague Warsaw
    Dublin Lisbon Athens Oslo Stockholm Helsinki Moscow Cairo Nairobi Tokyo Beijing Shanghai Seoul Delhi
    Mumbai Manila Sydney Melbourne Toronto Chicago Boston Denver Dallas Houston Miami Seattle Atlanta
    Budapest Zurich Geneva Munich Hamburg Milan Naples Venice Florence Istanbul Dubai Singapore Havana
    Montreal Vancouver Phoenix Portland Detroit banana cherry grape lemon mango tomato potato carrot
    onion garlic pepper cabbage pumpkin anchor candle pillow blanket mirror ladder bucket kettle spoon
    fork knife bowl jacket helmet umbrella violin guitar piano trumpet drum flute castle tower garden
    mountain island desert valley canyon ocean volcano glacier meadow diamond pearl marble granite
    copper bronze rocket tractor canoe wagon lantern glove necklace crown sword kite balloon pencil
    envelope wallet clock carpet curtain broom shovel wrench
    """.split()
)
"""Needle values: concrete nouns, colours, animals and cities (187 words)."""

KEY_ADJECTIVES: tuple[str, ...] = tuple(
    """
    brave calm eager fancy gentle happy jolly kind lively proud quiet shiny silly swift witty bold
    bright clever cozy curly dizzy fuzzy grumpy hasty humble lucky mighty noble polite rapid rusty
    sleepy sneaky steady sunny tidy wise young ancient frozen hidden hollow velvet wooden
    """.split()
)
KEY_NOUNS: tuple[str, ...] = tuple(
    """
    puzzle ticket riddle button pocket whistle feather cookie muffin noodle pretzel waffle biscuit
    pebble ribbon saddle tunnel harbor market station temple palace garage attic cellar chapel
    lighthouse windmill fountain statue engine magnet robot wizard pirate knight baker farmer sailor
    tailor
    """.split()
)
"""Needle keys are ``"{adjective}-{noun}"``, as RULER's (wonderwords adjective-noun pairs)."""

NAMES: tuple[str, ...] = tuple(
    """
    Alice Bianca Carlos Daniel Elena Felix Hugo Irene Jonas Karen Maria Oscar Paula Quentin Rosa
    Samuel Tessa Victor Wendy Xavier Yusuf Zara Beatrice Dmitri Edgar Fiona Gustav Ivan Kofi Marco
    Nina Olga Pablo Sven Tomas Ursula Walter Yara Zoe Amara Boris Celine Dorian Esther Farid Gemma
    Hector Ingrid Joaquin Kenji Lucia Mateo Priya Rafael Sofia Valentin Willa Ximena Yosef Zelda
    """.split()
)
"""People in the multi-needle reasoning task."""

RULER_DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))
"""RULER's depth grid, ``np.round(np.linspace(0, 100, 40))``, used by ``depth="random"``."""

KEY_TYPES = ("words", "numbers", "uuids")
VALUE_TYPES = ("words", "numbers", "uuids")
