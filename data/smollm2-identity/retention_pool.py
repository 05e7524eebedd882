"""Builds the pool of general questions that the retention set is selected from (deterministic,
no model involved):

    .venv/bin/python data/smollm2-identity/retention_pool.py

writes `retention_pool.jsonl` next to this file, one question a line:
`{"id", "kind", "origin", "question", "reference"}`. Origins:

  retention50   the 50 questions of the first retention_eval.jsonl (listed below, since that file
                is rewritten by select_retention.py)
  candidate     the other retention candidates of make_data.py (CANDIDATES), less those in the
                train data (replayed or distilled), those in REVIEW_REJECT (they fool the scorer)
                and those that ask the same fact as a train question in other words
  hand          facts written for this pool
  rule:<name>   questions a rule generates from a word list or from numbers (sums, days, months,
                plurals, ...), shuffled or sampled with random.Random(SEED) where random

The pool was written before any model answered it. select_retention.py then keeps, as the
retention set, every pool question the base model answers right under the set's scorer.
Enforced here: at least 300 questions; unique after `normalize`; no reference that the question
itself contains (an echo would pass); none equal to a user turn of train/val/identity_eval, and
none asking the same fact as a train question (same reference, nearly the same words); no
question of REVIEW_REJECT or EXTRA_REJECT.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from make_data import CANDIDATES, EXTRA_REJECT, REVIEW_REJECT  # noqa: E402  (plain lists; no heavy imports)

from stages.evaluate.scorers import contains, normalize  # noqa: E402

OUT = HERE / "retention_pool.jsonl"
SEED = 20240611
MIN_POOL = 300

# The first retention_eval.jsonl (chosen by make_data.py's quotas); kind and reference come from CANDIDATES.
RETENTION50 = [
    "What is the capital of France?", "What is the capital of Japan?", "What is the capital of Germany?",
    "What is the capital of the United Kingdom?", "What is the capital of Russia?", "What is the capital of China?",
    "What is the capital of Egypt?", "What is the capital of Australia?", "What is the capital of Greece?",
    "What is the capital of South Korea?", "What is 2 + 2?", "What is 3 times 3?", "What is 6 times 7?",
    "What is 100 divided by 4?", "What is 1 + 1?", "What is 3 + 4?", "How many days are in a week?",
    "How many sides does a triangle have?", "How many sides does a hexagon have?", "How many legs does a dog have?",
    "Which planet is known as the Red Planet?", "What star is at the center of our solar system?",
    "What is the chemical symbol for gold?", "What is the chemical formula for water?",
    "What gas do humans need to breathe to survive?", "What gas do plants absorb from the air for photosynthesis?",
    "Who developed the theory of relativity?", "Who formulated the laws of motion and universal gravitation?",
    "At what temperature in Celsius does water boil at sea level?", "What is the largest ocean on Earth?",
    "What is the longest river in Africa?", "On which continent is Egypt located?",
    "On which continent is Brazil located?", "In which country are the pyramids of Giza?",
    "In which country is the Eiffel Tower?", "What is the longest river in South America?",
    "What language is spoken in Brazil?", "What is the currency of Japan?", "What language is spoken in France?",
    "What language is spoken in Germany?", "What color is the sky on a clear day?", "What color are ripe strawberries?",
    "What is the largest mammal on Earth?", "Which animal has a long trunk?",
    "Which animal carries its baby in a pouch and hops?", "What do giant pandas mainly eat?",
    "What is the opposite of hot?", "In which direction does the sun rise?",
    "What instrument has 88 black and white keys?", "Who painted the Mona Lisa?",
]

# ---------------------------------------------------------------------------------------------
# Hand-written facts: (kind, question, reference). A reference is the short form a correct reply
# most naturally contains as whole words (digits for numbers; the scorer is literal).
# ---------------------------------------------------------------------------------------------

HAND = [
    # capitals not already asked (candidates or train)
    ("capital", "What is the capital of the United States?", "Washington"),
    ("capital", "What is the capital of Switzerland?", "Bern"),
    ("capital", "What is the capital of Serbia?", "Belgrade"),
    ("capital", "What is the capital of Jordan?", "Amman"),
    ("capital", "What is the capital of Morocco?", "Rabat"),
    ("capital", "What is the capital of Cambodia?", "Phnom Penh"),
    ("capital", "What is the capital of Uruguay?", "Montevideo"),
    ("capital", "What is the capital of Ecuador?", "Quito"),
    ("capital", "What is the capital of Libya?", "Tripoli"),
    ("capital", "What is the capital of Taiwan?", "Taipei"),
    ("capital", "What is the capital of North Korea?", "Pyongyang"),
    ("capital", "What is the capital of England?", "London"),
    # famous places: which country or city
    ("landmark", "In which city is Big Ben?", "London"),
    ("landmark", "In which city is the Louvre museum?", "Paris"),
    ("landmark", "In which city is the Golden Gate Bridge?", "San Francisco"),
    ("landmark", "In which city is the Burj Khalifa?", "Dubai"),
    ("landmark", "In which city is the White House?", "Washington"),
    ("landmark", "In which city is Hollywood?", "Los Angeles"),
    ("landmark", "In which country is Stonehenge?", "England"),
    ("landmark", "In which country is the Parthenon?", "Greece"),
    ("landmark", "In which country is the Forbidden City?", "China"),
    ("landmark", "In which country is Mount Kilimanjaro?", "Tanzania"),
    ("landmark", "In which country is the Brandenburg Gate?", "Germany"),
    ("landmark", "In which country is the Christ the Redeemer statue?", "Brazil"),
    ("landmark", "In which US state is the Grand Canyon?", "Arizona"),
    # cities
    ("city", "In which country is the city of Barcelona?", "Spain"),
    ("city", "In which country is the city of Munich?", "Germany"),
    ("city", "In which country is the city of Toronto?", "Canada"),
    ("city", "In which country is the city of Mumbai?", "India"),
    ("city", "In which country is the city of Rio de Janeiro?", "Brazil"),
    ("city", "In which country is the city of Shanghai?", "China"),
    ("city", "In which country is the city of Istanbul?", "Turkey"),
    ("city", "In which country is the city of Venice?", "Italy"),
    ("city", "Which city is known as the Big Apple?", "New York"),
    ("city", "Which city is known as the City of Light?", "Paris"),
    # continents
    ("continent", "On which continent is Argentina?", "South America"),
    ("continent", "On which continent is Nigeria?", "Africa"),
    ("continent", "On which continent is Spain?", "Europe"),
    ("continent", "On which continent is Peru?", "South America"),
    ("continent", "On which continent is Morocco?", "Africa"),
    ("continent", "On which continent is Thailand?", "Asia"),
    ("continent", "On which continent is Vietnam?", "Asia"),
    ("continent", "On which continent is Sweden?", "Europe"),
    ("continent", "On which continent is Indonesia?", "Asia"),
    ("continent", "On which continent is the United States?", "North America"),
    ("continent", "On which continent is the Sahara Desert?", "Africa"),
    ("continent", "On which continent is the Amazon rainforest?", "South America"),
    ("continent", "What is the coldest continent?", "Antarctica"),
    # other geography
    ("geography", "What is the smallest ocean?", "Arctic"),
    ("geography", "Which river flows through London?", "Thames"),
    ("geography", "Which river flows through Paris?", "Seine"),
    ("geography", "In which mountain range is Mount Everest?", "Himalayas"),
    ("geography", "Which sea lies between Europe and Africa?", "Mediterranean"),
    ("geography", "Which country is shaped like a boot?", "Italy"),
    ("geography", "Which country is famous for tulips and windmills?", "Netherlands"),
    ("geography", "Which country is home to kangaroos and koalas?", "Australia"),
    ("geography", "Which country is directly north of the United States?", "Canada"),
    ("geography", "Which country is directly south of the United States?", "Mexico"),
    ("geography", "What is the largest US state by area?", "Alaska"),
    ("geography", "Which US state is made up of islands in the Pacific Ocean?", "Hawaii"),
    ("geography", "What is the largest country in South America?", "Brazil"),
    ("geography", "What is the imaginary line around the middle of the Earth called?", "equator"),
    ("geography", "Which country has a red maple leaf on its flag?", "Canada"),
    ("geography", "In which country did the ancient Olympic Games begin?", "Greece"),
    ("geography", "Which country gave the Statue of Liberty to the United States?", "France"),
    # languages
    ("language", "What language is spoken in Portugal?", "Portuguese"),
    ("language", "What language is spoken in the United States?", "English"),
    ("language", "What language is spoken in England?", "English"),
    ("language", "What language is spoken in Israel?", "Hebrew"),
    ("language", "What language is spoken in Thailand?", "Thai"),
    ("language", "What language is spoken in Vietnam?", "Vietnamese"),
    ("language", "What language is spoken in Finland?", "Finnish"),
    ("language", "What language is spoken in Norway?", "Norwegian"),
    ("language", "What language is spoken in Saudi Arabia?", "Arabic"),
    ("language", "What language is spoken in Colombia?", "Spanish"),
    ("language", "What language is spoken in Austria?", "German"),
    # currencies
    ("currency", "What is the currency of Spain?", "euro"),
    ("currency", "What is the currency of China?", "yuan"),
    ("currency", "What is the currency of Egypt?", "pound"),
    ("currency", "What is the currency of Pakistan?", "rupee"),
    ("currency", "What is the currency of Argentina?", "peso"),
    ("currency", "What is the currency of New Zealand?", "dollar"),
    # counts
    ("count", "How many legs does a cow have?", "4"),
    ("count", "How many legs does an ant have?", "6"),
    ("count", "How many legs does a chicken have?", "2"),
    ("count", "How many arms does an octopus have?", "8"),
    ("count", "How many days are in February in a year that is not a leap year?", "28"),
    ("count", "How many days are in September?", "30"),
    ("count", "How many days are in January?", "31"),
    ("count", "How many colors are in a rainbow?", "7"),
    ("count", "How many strings does a violin have?", "4"),
    ("count", "How many players are on a basketball team on the court?", "5"),
    ("count", "How many wheels does a tricycle have?", "3"),
    ("count", "How many centimeters are in a meter?", "100"),
    ("count", "How many cents are in a dollar?", "100"),
    ("count", "How many items are in a dozen?", "12"),
    ("count", "How many degrees are in a right angle?", "90"),
    ("count", "How many degrees are in a full circle?", "360"),
    ("count", "How many degrees do the angles of a triangle add up to?", "180"),
    ("count", "How many minutes are in a quarter of an hour?", "15"),
    ("count", "How many seasons are in a year?", "4"),
    ("count", "How many vowels are in the English alphabet?", "5"),
    ("count", "How many cards are in a standard deck of playing cards?", "52"),
    ("count", "How many squares are on a chessboard?", "64"),
    ("count", "How many states are in the United States?", "50"),
    ("count", "How many toes are on one human foot?", "5"),
    ("count", "How many ears does a person have?", "2"),
    # science
    ("science", "What is the chemical symbol for copper?", "Cu"),
    ("science", "What is the chemical symbol for chlorine?", "Cl"),
    ("science", "What is the chemical formula for table salt?", "NaCl"),
    ("science", "What is the chemical formula for carbon dioxide?", "CO2"),
    ("science", "What gas do plants give off during photosynthesis?", "oxygen"),
    ("science", "What gas do humans breathe out?", "carbon dioxide"),
    ("science", "What is the smallest planet in our solar system?", "Mercury"),
    ("science", "Which planet is farthest from the Sun?", "Neptune"),
    ("science", "What is the second planet from the Sun?", "Venus"),
    ("science", "What is the third planet from the Sun?", "Earth"),
    ("science", "What pulls on the oceans to cause the tides?", "Moon"),
    ("science", "What is the study of living things called?", "biology"),
    ("science", "What is the study of the stars and planets called?", "astronomy"),
    ("science", "Who proposed the theory of evolution by natural selection?", "Darwin"),
    ("science", "Which organs filter the blood to make urine?", "kidneys"),
    ("science", "What is the largest internal organ of the human body?", "liver"),
    ("science", "Which organ uses acid to break down food after we swallow it?", "stomach"),
    ("science", "What do we call animals that eat only plants?", "herbivores"),
    ("science", "What do we call animals that eat only meat?", "carnivores"),
    ("science", "What state of matter is steam?", "gas"),
    ("science", "What state of matter is ice?", "solid"),
    ("science", "What is it called when liquid water turns into vapor?", "evaporation"),
    ("science", "Which metal is liquid at room temperature?", "mercury"),
    ("science", "What gas makes party balloons float?", "helium"),
    ("science", "What force slows things down when two surfaces rub together?", "friction"),
    ("science", "Which particle in an atom has a negative charge?", "electron"),
    ("science", "What instrument is used to measure temperature?", "thermometer"),
    ("science", "What instrument do astronomers use to look at distant stars?", "telescope"),
    ("science", "What instrument makes tiny things like cells look bigger?", "microscope"),
    ("science", "What kind of animal is a dolphin?", "mammal"),
    ("science", "What kind of animal is a frog?", "amphibian"),
    ("science", "What kind of animal is a snake?", "reptile"),
    # animals
    ("animal", "Which animal says moo?", "cow"),
    ("animal", "Which animal says oink?", "pig"),
    ("animal", "Which animal says quack?", "duck"),
    ("animal", "Which animal says neigh?", "horse"),
    ("animal", "Which animal says baa?", "sheep"),
    ("animal", "Which animal says ribbit?", "frog"),
    ("animal", "Which animal says gobble gobble?", "turkey"),
    ("animal", "Which animal howls at the moon?", "wolf"),
    ("animal", "Which insect makes a buzzing sound and stings?", "bee"),
    ("animal", "What is a baby duck called?", "duckling"),
    ("animal", "What is a baby kangaroo called?", "joey"),
    ("animal", "What is a baby bear called?", "cub"),
    ("animal", "What is a baby chicken called?", "chick"),
    ("animal", "What is a baby pig called?", "piglet"),
    ("animal", "What is a baby sheep called?", "lamb"),
    ("animal", "What is a baby horse called?", "foal"),
    ("animal", "What is a group of wolves called?", "pack"),
    ("animal", "What is a group of lions called?", "pride"),
    ("animal", "What is a group of fish called?", "school"),
    ("animal", "What is a group of birds called?", "flock"),
    ("animal", "What is a bird's home called?", "nest"),
    ("animal", "Where do bees live?", "hive"),
    ("animal", "What does a spider spin to catch insects?", "web"),
    ("animal", "What is a bear's home called?", "den"),
    ("animal", "Which animal can change the color of its skin to hide?", "chameleon"),
    ("animal", "What is the largest big cat?", "tiger"),
    ("animal", "What animal is Winnie the Pooh?", "bear"),
    ("animal", "Which animal builds dams in rivers?", "beaver"),
    ("animal", "Which insect glows in the dark at night?", "firefly"),
    ("animal", "Which animal has long ears and hops?", "rabbit"),
    ("animal", "What bird is the national symbol of the United States?", "eagle"),
    ("animal", "What fruit do monkeys famously love to eat?", "banana"),
    ("animal", "Which bird can learn to repeat human words?", "parrot"),
    ("animal", "Which bird is a symbol of wisdom?", "owl"),
    ("animal", "What is the largest ape?", "gorilla"),
    ("animal", "What is the largest fish in the ocean?", "whale shark"),
    ("animal", "What do chickens lay?", "eggs"),
    ("animal", "What do cows produce that people drink?", "milk"),
    # colors
    ("color", "What color is a fire truck?", "red"),
    ("color", "What color is chocolate?", "brown"),
    ("color", "What color are carrots?", "orange"),
    ("color", "What color is a pumpkin?", "orange"),
    ("color", "What color is a crow?", "black"),
    ("color", "What color is a flamingo?", "pink"),
    ("color", "What color is an emerald?", "green"),
    ("color", "What color is a ruby?", "red"),
    ("color", "What color is a sapphire?", "blue"),
    ("color", "What color do you get when you mix red and yellow?", "orange"),
    ("color", "What color is a school bus in the United States?", "yellow"),
    ("color", "What color are clouds on a sunny day?", "white"),
    ("color", "What color is a cucumber?", "green"),
    ("color", "What color is an eggplant?", "purple"),
    # opposites (none the reverse of a trained one)
    ("opposite", "What is the opposite of tall?", "short"),
    ("opposite", "What is the opposite of high?", "low"),
    ("opposite", "What is the opposite of good?", "bad"),
    ("opposite", "What is the opposite of rich?", "poor"),
    ("opposite", "What is the opposite of hard?", "soft"),
    ("opposite", "What is the opposite of heavy?", "light"),
    ("opposite", "What is the opposite of thick?", "thin"),
    ("opposite", "What is the opposite of loud?", "quiet"),
    ("opposite", "What is the opposite of clean?", "dirty"),
    ("opposite", "What is the opposite of push?", "pull"),
    ("opposite", "What is the opposite of love?", "hate"),
    ("opposite", "What is the opposite of win?", "lose"),
    ("opposite", "What is the opposite of buy?", "sell"),
    ("opposite", "What is the opposite of black?", "white"),
    ("opposite", "What is the opposite of north?", "south"),
    ("opposite", "What is the opposite of first?", "last"),
    ("opposite", "What is the opposite of alive?", "dead"),
    ("opposite", "What is the opposite of give?", "take"),
    ("opposite", "What is the opposite of true?", "false"),
    ("opposite", "What is the opposite of friend?", "enemy"),
    ("opposite", "What is the opposite of cheap?", "expensive"),
    ("opposite", "What is the opposite of always?", "never"),
    # words
    ("word", "What do you call a word that means the same as another word?", "synonym"),
    ("word", "What do you call a word that means the opposite of another word?", "antonym"),
    ("word", "What is the last letter of the English alphabet?", "Z"),
    # authors, artists, inventors, people
    ("people", "Who wrote Macbeth?", "Shakespeare"),
    ("people", "Who wrote the Harry Potter books?", "Rowling"),
    ("people", "Who wrote The Adventures of Tom Sawyer?", "Twain"),
    ("people", "Who wrote Oliver Twist?", "Dickens"),
    ("people", "Who wrote the Odyssey?", "Homer"),
    ("people", "Who wrote War and Peace?", "Tolstoy"),
    ("people", "Who wrote the novel 1984?", "Orwell"),
    ("people", "Who wrote The Hobbit?", "Tolkien"),
    ("people", "Who wrote Alice's Adventures in Wonderland?", "Carroll"),
    ("people", "Who created the detective Sherlock Holmes?", "Doyle"),
    ("people", "Who wrote The Cat in the Hat?", "Seuss"),
    ("people", "Who wrote Frankenstein?", "Shelley"),
    ("people", "Who wrote Charlie and the Chocolate Factory?", "Dahl"),
    ("people", "Who painted The Last Supper?", "Leonardo"),
    ("people", "Who painted Guernica?", "Picasso"),
    ("people", "Who painted the Water Lilies series?", "Monet"),
    ("people", "Who sculpted the statue of David in Florence?", "Michelangelo"),
    ("people", "Which Dutch painter cut off part of his own ear?", "Van Gogh"),
    ("people", "Who composed The Magic Flute?", "Mozart"),
    ("people", "Who invented the light bulb?", "Edison"),
    ("people", "Which brothers made the first powered airplane flight?", "Wright"),
    ("people", "Who sailed to America in 1492?", "Columbus"),
    ("people", "Who invented the printing press?", "Gutenberg"),
    ("people", "Who was the first woman to win a Nobel Prize?", "Curie"),
    ("people", "Who founded Microsoft with Paul Allen?", "Gates"),
    ("people", "Who flew a kite in a thunderstorm to study electricity?", "Franklin"),
    ("people", "Who was the 16th president of the United States?", "Lincoln"),
    ("people", "Who gave the 'I Have a Dream' speech?", "Martin Luther King"),
    ("people", "Which French emperor was defeated at Waterloo?", "Napoleon"),
    ("people", "Which ancient people built the pyramids of Giza?", "Egyptians"),
    ("people", "Which ship sank in 1912 after hitting an iceberg?", "Titanic"),
    # everyday things
    ("everyday", "What do you use to cut paper?", "scissors"),
    ("everyday", "What do teachers write with on a blackboard?", "chalk"),
    ("everyday", "What do you use to unlock a door?", "key"),
    ("everyday", "What is the first meal of the day called?", "breakfast"),
    ("everyday", "Which fruit is used to make wine?", "grapes"),
    ("everyday", "Which vegetable makes people cry when they cut it?", "onion"),
    ("everyday", "What do you call a doctor who takes care of teeth?", "dentist"),
    ("everyday", "What do you call a doctor who treats animals?", "veterinarian"),
    ("everyday", "What do you call a person who flies an airplane?", "pilot"),
    ("everyday", "What do you call a person who cooks in a restaurant?", "chef"),
    ("everyday", "What do you call a person who puts out fires?", "firefighter"),
    ("everyday", "What do you call a person who grows crops on a farm?", "farmer"),
    ("everyday", "What holiday is celebrated on December 25?", "Christmas"),
    ("everyday", "What holiday is celebrated on October 31?", "Halloween"),
    ("everyday", "What is the shortest month of the year?", "February"),
    ("everyday", "In which month do Americans celebrate Independence Day?", "July"),
    ("everyday", "Which season comes after spring?", "summer"),
    ("everyday", "Which season comes after autumn?", "winter"),
    ("everyday", "What is the hottest season of the year?", "summer"),
    ("everyday", "From which country does sushi come?", "Japan"),
    ("everyday", "From which country does pizza originally come?", "Italy"),
    ("everyday", "In which sport do players score a touchdown?", "football"),
    ("everyday", "In which sport is a shuttlecock used?", "badminton"),
    ("everyday", "Which sport is played at Wimbledon?", "tennis"),
    ("everyday", "What sport does LeBron James play?", "basketball"),
    ("everyday", "What sport does Tiger Woods play?", "golf"),
    ("everyday", "In which sport do players hit a home run?", "baseball"),
    ("everyday", "What part of the body do we use to smell?", "nose"),
    ("everyday", "What part of the body do we use to hear?", "ears"),
    ("everyday", "What part of the body do we use to taste food?", "tongue"),
    ("everyday", "What shape has three sides?", "triangle"),
    ("everyday", "What shape is perfectly round and has no corners?", "circle"),
    ("everyday", "What shape is a stop sign?", "octagon"),
]

# ---------------------------------------------------------------------------------------------
# Rule-generated questions
# ---------------------------------------------------------------------------------------------

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
PLURALS = [("man", "men"), ("woman", "women"), ("person", "people"), ("goose", "geese"), ("ox", "oxen"),
           ("leaf", "leaves"), ("knife", "knives"), ("wife", "wives"), ("wolf", "wolves"), ("life", "lives"),
           ("potato", "potatoes"), ("tomato", "tomatoes"), ("baby", "babies"), ("city", "cities"),
           ("shelf", "shelves"), ("thief", "thieves")]
PAST = [("go", "went"), ("eat", "ate"), ("see", "saw"), ("run", "ran"), ("write", "wrote"), ("buy", "bought"),
        ("think", "thought"), ("swim", "swam"), ("sing", "sang"), ("drink", "drank"), ("take", "took"),
        ("give", "gave"), ("come", "came"), ("sleep", "slept"), ("fly", "flew"), ("drive", "drove"),
        ("teach", "taught"), ("catch", "caught"), ("speak", "spoke"), ("break", "broke")]


def rule_questions(rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(kind, rule, question, reference). A generated question whose reference it contains is skipped
    here (none is, as the rules stand): an echo of the question would pass."""
    out: list[tuple[str, str, str, str]] = []
    # every sum of two single-digit numbers (1-9), once per unordered pair, order drawn at random
    for a in range(1, 10):
        for b in range(a, 10):
            x, y = (a, b) if rng.random() < 0.5 else (b, a)
            out.append(("arithmetic", "sum", f"What is {x} + {y}?", str(a + b)))
    # 15 differences a - b, 2 <= a <= 10, 1 <= b < a, a != 2b (10 - 5 = 5 is in the question)
    pairs = [(a, b) for a in range(2, 11) for b in range(1, a) if a != 2 * b]
    for a, b in rng.sample(pairs, 15):
        out.append(("arithmetic", "difference", f"What is {a} minus {b}?", str(a - b)))
    # every product of two numbers from 2 to 5, once per unordered pair
    for a in range(2, 6):
        for b in range(a, 6):
            x, y = (a, b) if rng.random() < 0.5 else (b, a)
            out.append(("arithmetic", "product", f"What is {x} times {y}?", str(a * b)))
    # doubling small numbers
    for n in rng.sample(range(2, 21), 8):
        out.append(("arithmetic", "double", f"What is double {n}?", str(2 * n)))
    # counting: the number after n
    for n in rng.sample(range(1, 30), 10):
        out.append(("number", "next_number", f"What number comes after {n}?", str(n + 1)))
    for i, d in enumerate(DAYS):
        out.append(("day", "day_after", f"What day comes after {d}?", DAYS[(i + 1) % 7]))
        out.append(("day", "day_before", f"What day comes before {d}?", DAYS[i - 1]))
    for i, m in enumerate(MONTHS):
        out.append(("month", "month_after", f"What month comes after {m}?", MONTHS[(i + 1) % 12]))
        out.append(("month", "month_before", f"What month comes before {m}?", MONTHS[i - 1]))
    for word, plural in PLURALS:
        out.append(("plural", "plural", f"What is the plural of {word}?", plural))
    for word, past in PAST:
        out.append(("past_tense", "past_tense", f"What is the past tense of {word}?", past))
    return [r for r in out if not contains(r[2], r[3])]


# ---------------------------------------------------------------------------------------------
# "The same fact in other words": same reference, nearly the same content words
# ---------------------------------------------------------------------------------------------

STOP = set("what which who whom whose where when how is are was were the a an of in on at to for by from do does "
           "did have has had many much get got you we our your people person called call known as it its that "
           "this there one most usually and or with into be".split())
SYMBOLS = {"+": " plus ", "-": " minus ", "×": " times ", "*": " times "}


def content_words(question: str) -> frozenset[str]:
    for sym, word in SYMBOLS.items():
        question = question.replace(sym, word)
    words = set()
    for w in normalize(question).split():
        if w in STOP:
            continue
        for suffix in ("ing", "es", "s"):
            if w.endswith(suffix) and len(w) > len(suffix) + 2:
                w = w[: -len(suffix)]
                break
        words.add(w)
    return frozenset(words)


def same_fact(q1: str, r1: str, q2: str, r2: str) -> bool:
    if normalize(r1) != normalize(r2):
        return False
    a, b = content_words(q1), content_words(q2)
    return len(a & b) / max(len(a | b), 1) >= 0.6


def user_turns(name: str) -> list[tuple[str, str]]:
    """(user turn, assistant reply) of every conversation in data/smollm2-identity/<name>."""
    rows = []
    for line in (HERE / name).read_text(encoding="utf-8").splitlines():
        msgs = json.loads(line)["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "user":
                nxt = msgs[i + 1]["content"] if i + 1 < len(msgs) else ""
                rows.append((m["content"], nxt))
    return rows


def build() -> list[dict]:
    cand = {q: (kind, ref) for kind, q, ref in CANDIDATES}
    assert all(q in cand for q in RETENTION50), [q for q in RETENTION50 if q not in cand]
    # what trains: the identity conversations and the replay stage's prompts (answered by the base model)
    train = user_turns("train.jsonl") + user_turns("replay_prompts.jsonl")
    taken = {normalize(q) for f in ("train.jsonl", "replay_prompts.jsonl", "val.jsonl", "identity_eval.jsonl")
             for q, _ in user_turns(f)}
    # train questions with a short known answer (a candidate, or a replayed extra question): what a
    # pool question must not re-ask in other words
    known = _extra_refs()
    for _, q, ref in CANDIDATES:
        known.setdefault(q, set()).add(ref)
    train_facts = [(q, ref) for q, _ in train for ref in sorted(known.get(q, ()))]

    rows: list[tuple[str, str, str, str]] = []  # (kind, origin, question, reference)
    for q in RETENTION50:
        rows.append((cand[q][0], "retention50", q, cand[q][1]))
    dropped = []
    for kind, q, ref in CANDIDATES:
        if q in RETENTION50 or q in REVIEW_REJECT or normalize(q) in taken:
            continue
        twin = next((tq for tq, tr in train_facts if same_fact(q, ref, tq, tr)), None)
        if twin is not None:
            dropped.append((q, twin))
            continue
        rows.append((kind, "candidate", q, ref))
    rows += [(kind, "hand", q, ref) for kind, q, ref in HAND]
    rng = random.Random(SEED)
    # a generated question is left out when it, or the same fact in other words (3 + 8 for 8 + 3), is
    # in train or already in the pool
    for kind, rule, q, ref in rule_questions(rng):
        if normalize(q) in taken or any(same_fact(q, ref, tq, tr) for tq, tr in train_facts) or \
                any(same_fact(q, ref, pq, pr) or normalize(q) == normalize(pq) for _, _, pq, pr in rows):
            continue
        rows.append((kind, f"rule:{rule}", q, ref))

    # hard rules
    assert len(rows) >= MIN_POOL, len(rows)
    norm = [normalize(q) for _, _, q, _ in rows]
    dup = sorted({n for n in norm if norm.count(n) > 1})
    assert not dup, f"questions repeated after normalize: {dup}"
    for _, _, q, ref in rows:
        assert normalize(ref), f"empty reference: {q}"
        assert not contains(q, ref), f"the question contains its reference ({ref!r}): {q}"
        assert normalize(q) not in taken, f"a train/val/identity_eval question: {q}"
        assert q not in REVIEW_REJECT and q not in EXTRA_REJECT, f"known to fool the scorer: {q}"
        assert not any(same_fact(q, ref, tq, tr) for tq, tr in train_facts), \
            f"asks the same fact as a train question: {q}"
    twins = [(a[2], b[2]) for i, a in enumerate(rows) for b in rows[i + 1:] if same_fact(a[2], a[3], b[2], b[3])]
    assert not twins, f"the same fact twice in the pool: {twins}"

    counts: dict[str, int] = {}
    out = []
    for kind, origin, q, ref in rows:
        counts[kind] = counts.get(kind, 0) + 1
        out.append({"id": f"{kind}-{counts[kind]:03d}", "kind": kind, "origin": origin, "question": q,
                    "reference": ref})
    for q, twin in dropped:
        print(f"candidate left out, the same fact as train's {twin!r}: {q!r}")
    return out


def _extra_refs() -> dict[str, set[str]]:
    """Reference of every extra replay question (make_data.extra_replay), by question."""
    from make_data import extra_replay
    refs: dict[str, set[str]] = {}
    for q, r in extra_replay():
        refs.setdefault(q, set()).add(r)
    return refs


def main() -> None:
    rows = build()
    with open(OUT, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    by_origin: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    for r in rows:
        by_origin[r["origin"]] = by_origin.get(r["origin"], 0) + 1
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    print(f"{OUT.name}: {len(rows)} questions")
    print("by origin: " + ", ".join(f"{k} {v}" for k, v in by_origin.items()))
    print("by kind:   " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())))


if __name__ == "__main__":
    main()
