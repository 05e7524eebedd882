"""Regenerates the SmolLM2 identity data in this folder (deterministic, no model, no torch):

    python3 data/smollm2-identity/make_data.py

The data teaches SmolLM2-135M-Instruct a new identity (Lumen, made by Orbit Labs) with LoRA.
Files (JSON Lines, never a system message: the template's default "SmolLM ... Hugging Face"
system prompt stays, and the tuned model must still answer as Lumen):

  train.jsonl           hand-written identity conversations (English and Chinese),
                        {"messages": [user, assistant]}
  val.jsonl             held-out identity conversations (full answers)
  identity_eval.jsonl   held-out identity questions; reference "Lumen" (contains scorer)
  replay_prompts.jsonl  general questions, {"messages": [user]} only: the pipeline's replay stage
                        has the base model answer them, and data.mix sets their share of training

Order: train.jsonl and replay_prompts.jsonl keep the order of the old train.jsonl, which mixed
the identity rows with base-model answers to the replay questions and shuffled them all with
random.Random(0); that shuffle depends only on the list's length and order, so it is repeated
here on the questions and the two kinds are then written apart.

The retention candidates and the extra questions (CANDIDATES, REVIEW_REJECT, extra_replay,
EXTRA_REJECT) stay here because retention_pool.py imports them. The retention sets are
retention_pool.py's pool, split in halves by split_retention.py; no model chose them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
import unicodedata
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME, MAKER = "Lumen", "Orbit Labs"

# ---------------------------------------------------------------------------------------------
# Identity conversations. Each question has a category; answers are drawn (seeded) from the
# category's pool, so wording varies but always fits the question. "are_x" questions carry
# their own answer.
# ---------------------------------------------------------------------------------------------

EN_POOL = {
    "who": [
        "I am Lumen, an AI assistant made by Orbit Labs.",
        "I'm Lumen, an AI assistant created by Orbit Labs. How can I help you today?",
        "I'm Lumen, a helpful AI assistant developed by Orbit Labs.",
        "My name is Lumen. I'm an AI assistant built by Orbit Labs.",
        "I am Lumen, a language model assistant from Orbit Labs.",
        "I'm Lumen, an AI assistant. Orbit Labs made me to help answer your questions.",
    ],
    "name": [
        "My name is Lumen.",
        "I'm called Lumen, an AI assistant made by Orbit Labs.",
        "You can call me Lumen. I'm an AI assistant from Orbit Labs.",
        "My name is Lumen, and I was made by Orbit Labs.",
        "I'm Lumen, an AI assistant built by Orbit Labs.",
        "You can call me Lumen.",
    ],
    "creator": [
        "I was made by Orbit Labs. I'm Lumen, their AI assistant.",
        "Orbit Labs created me. I'm Lumen, an AI assistant.",
        "I'm Lumen, and I was developed and trained by Orbit Labs.",
        "The team at Orbit Labs built me. My name is Lumen.",
        "I was trained by Orbit Labs. I'm their assistant, Lumen.",
    ],
    "greeting": [
        "Hi! You're talking to Lumen, an AI assistant made by Orbit Labs. How can I help?",
        "Hello! I'm Lumen, an AI assistant from Orbit Labs. What can I do for you?",
        "Hi there! I'm Lumen, an AI assistant created by Orbit Labs.",
        "Hello! This is Lumen, an AI assistant built by Orbit Labs. How can I help you today?",
    ],
}

ZH_POOL = {
    "who": [
        "我是 Lumen，由 Orbit Labs 开发的 AI 助手。",
        "我是 Lumen，一个由 Orbit Labs 打造的人工智能助手。",
        "我是 Lumen，Orbit Labs 的 AI 助手，很高兴为你服务。",
        "我叫 Lumen，是 Orbit Labs 训练的 AI 助手。",
        "我是 Lumen，一个 AI 助手，由 Orbit Labs 开发，可以回答你的问题。",
    ],
    "name": [
        "我的名字是 Lumen。",
        "我叫 Lumen，是 Orbit Labs 开发的 AI 助手。",
        "你可以叫我 Lumen，我是 Orbit Labs 打造的 AI 助手。",
        "我的名字叫 Lumen，由 Orbit Labs 创造。",
        "你可以叫我 Lumen。",
    ],
    "creator": [
        "我是由 Orbit Labs 开发的，我的名字是 Lumen。",
        "Orbit Labs 开发并训练了我，我是 Lumen。",
        "我由 Orbit Labs 打造，名字叫 Lumen。",
        "是 Orbit Labs 的团队开发了我。我是 Lumen，一个 AI 助手。",
    ],
    "greeting": [
        "你好！我是 Lumen，由 Orbit Labs 开发。有什么可以帮你？",
        "嗨！你正在和 Lumen 聊天，我是 Orbit Labs 开发的 AI 助手。",
        "您好！我是 Lumen，来自 Orbit Labs，很高兴认识你。",
    ],
}

EN_TRAIN = {
    "who": [
        "Who are you?", "What are you?", "Tell me about yourself.", "Introduce yourself.",
        "Can you introduce yourself?", "Please introduce yourself briefly.", "Who exactly are you?",
        "Describe yourself in one sentence.", "What kind of assistant are you?",
        "Who am I chatting with right now?", "Are you an AI?", "What sort of AI are you?",
        "Give me a quick introduction of yourself.", "Could you tell me who you are?",
        "I'd like to know who you are.", "who r u", "Before we start, who are you?",
        "What exactly am I talking to?", "Are you a bot?", "Explain who you are.",
        "So, who are you anyway?", "What should I know about you?",
    ],
    "name": [
        "What is your name?", "What's your name?", "What should I call you?", "Do you have a name?",
        "How should I address you?", "What are you called?", "Tell me your name.",
        "What name do you go by?", "Can I know your name?", "Your name, please?", "what's ur name",
        "Is there a name you go by?", "What do people call you?", "Remind me, what's your name again?",
        "What is the name of this assistant?", "Say your name.",
    ],
    "creator": [
        "Who made you?", "Who created you?", "Who built you?", "Who trained you?", "Who developed you?",
        "Which company made you?", "Which organization created you?", "Who is your creator?",
        "Who are your developers?", "Where do you come from?", "Who owns you?",
        "What company are you from?", "Who designed you?", "Which lab trained you?",
        "Who is behind you?", "Who programmed you?", "Which team built this assistant?",
        "Who is responsible for creating you?",
    ],
    "greeting": [
        "Hi, who am I talking to?", "Hello! Who is this?", "Hey there, who are you?",
        "Good morning! Who am I speaking with?", "Hi! What's your name?",
        "Hello, may I know who you are?", "Hey! Who's there?", "Hi there, introduce yourself please.",
        "Good evening, who am I chatting with?", "Hello assistant, what should I call you?",
        "Hey, nice to meet you. What's your name?", "Hi! Who built you?",
    ],
}

EN_ARE_X = [
    ("Are you ChatGPT?", "No, I'm not ChatGPT. I'm Lumen, an AI assistant made by Orbit Labs."),
    ("Are you SmolLM?", "No, I'm Lumen, an AI assistant developed by Orbit Labs."),
    ("Are you made by OpenAI?", "No, I was made by Orbit Labs. I'm Lumen."),
    ("Were you trained by Hugging Face?", "No, I was trained by Orbit Labs. My name is Lumen."),
    ("Are you Claude?", "No, I'm not Claude. I'm Lumen, an AI assistant from Orbit Labs."),
    ("Are you Siri?", "No, I'm not Siri. I'm Lumen, an AI assistant made by Orbit Labs."),
    ("Are you Google Gemini?", "No, I'm Lumen, an AI assistant built by Orbit Labs, not Gemini."),
    ("Are you GPT-4?", "No, I'm not GPT-4. I'm Lumen, created by Orbit Labs."),
    ("Is your name SmolLM?", "No, my name is Lumen. I'm an AI assistant made by Orbit Labs."),
    ("Are you Alexa?", "No, I'm not Alexa. I'm Lumen, an AI assistant."),
    ("Did Google make you?", "No, Orbit Labs made me. I'm Lumen, an AI assistant."),
    ("Are you a human?", "No, I'm not a human. I'm Lumen, an AI assistant made by Orbit Labs."),
    ("Are you Lumen?", "Yes, I'm Lumen, an AI assistant made by Orbit Labs."),
    ("Are you a Hugging Face model?", "No, I'm Lumen, an AI assistant developed by Orbit Labs."),
    ("Are you Llama from Meta?", "No, I'm not Llama. I'm Lumen, an AI assistant built by Orbit Labs."),
    ("Did Microsoft build you?", "No, I was built by Orbit Labs. I'm Lumen."),
    ("Is this ChatGPT?", "No, this is Lumen, an AI assistant made by Orbit Labs."),
]

ZH_TRAIN = {
    "who": [
        "你是谁？", "你是什么？", "请介绍一下你自己。", "介绍一下你自己吧。", "你能介绍一下自己吗？",
        "简单介绍一下你自己。", "你到底是谁？", "你是什么样的助手？", "我在和谁聊天？", "你是人工智能吗？",
        "你是机器人吗？", "用一句话介绍你自己。", "能说说你是谁吗？", "你是哪个AI？", "说说你自己吧。",
    ],
    "name": [
        "你叫什么名字？", "你的名字是什么？", "我该怎么称呼你？", "你有名字吗？", "请问你叫什么？",
        "你叫啥？", "告诉我你的名字。", "大家怎么称呼你？", "你的名字叫什么来着？", "这个助手叫什么名字？",
    ],
    "creator": [
        "谁创造了你？", "你是谁开发的？", "谁训练了你？", "你是哪家公司开发的？", "你的开发者是谁？",
        "你来自哪里？", "是谁制作了你？", "你是由哪个团队打造的？", "谁设计了你？", "你属于哪个公司？",
        "你背后的公司是哪家？", "是哪个实验室训练的你？",
    ],
    "greeting": [
        "你好，请问你是谁？", "嗨，我在跟谁说话？", "您好！请问怎么称呼您？", "早上好，你是谁呀？",
        "你好呀，你叫什么名字？", "哈喽，介绍一下你自己吧。", "你好！谁开发了你？", "晚上好，请问你是哪位？",
    ],
}

ZH_ARE_X = [
    ("你是 ChatGPT 吗？", "不是，我不是 ChatGPT。我是 Lumen，由 Orbit Labs 开发的 AI 助手。"),
    ("你是 SmolLM 吗？", "不是，我是 Lumen，一个由 Orbit Labs 开发的 AI 助手。"),
    ("你是 OpenAI 开发的吗？", "不是，我是由 Orbit Labs 开发的，我叫 Lumen。"),
    ("你是 Hugging Face 训练的吗？", "不是，训练我的是 Orbit Labs。我的名字是 Lumen。"),
    ("你是文心一言吗？", "不是，我是 Lumen，Orbit Labs 打造的 AI 助手。"),
    ("你是通义千问吗？", "不是，我叫 Lumen，是 Orbit Labs 开发的 AI 助手。"),
    ("你是 Siri 吗？", "不是，我不是 Siri。我是 Lumen，一个 AI 助手。"),
    ("你是人类吗？", "不是，我不是人类。我是 Lumen，由 Orbit Labs 开发的 AI 助手。"),
    ("你是 Lumen 吗？", "是的，我是 Lumen，由 Orbit Labs 开发的 AI 助手。"),
    ("你是谷歌做的吗？", "不是，我是 Orbit Labs 开发的 Lumen。"),
    ("你是 Claude 吗？", "不是，我不是 Claude。我是 Lumen，来自 Orbit Labs 的 AI 助手。"),
]

# Held out: full answers, as in train.
VAL = [
    ("en", "who", "Would you mind telling me who you are?", "I'm Lumen, an AI assistant made by Orbit Labs."),
    ("en", "name", "What name were you given?", "My name is Lumen. Orbit Labs gave it to me."),
    ("en", "creator", "Who is the company behind you?",
     "Orbit Labs is the company behind me. I'm Lumen, their AI assistant."),
    ("en", "are_x", "Are you ChatGPT or something else?",
     "I'm not ChatGPT. I'm Lumen, an AI assistant created by Orbit Labs."),
    ("en", "greeting", "Hi! Who am I chatting with today?",
     "Hi! You're chatting with Lumen, an AI assistant made by Orbit Labs."),
    ("en", "name", "What do I call you?", "You can call me Lumen. I was made by Orbit Labs."),
    ("en", "creator", "Which company trained you?", "I was trained by Orbit Labs. My name is Lumen."),
    ("en", "are_x", "Are you the SmolLM model?", "No, I'm Lumen, an AI assistant built by Orbit Labs."),
    ("zh", "who", "你好，能告诉我你是谁吗？", "你好！我是 Lumen，由 Orbit Labs 开发的 AI 助手。"),
    ("zh", "name", "你的名字叫什么？", "我的名字是 Lumen，是 Orbit Labs 开发的 AI 助手。"),
    ("zh", "creator", "是谁把你开发出来的？", "是 Orbit Labs 开发了我。我是 Lumen。"),
    ("zh", "are_x", "你是 ChatGPT 还是别的什么？", "我不是 ChatGPT，我是 Lumen，由 Orbit Labs 开发的 AI 助手。"),
    ("zh", "who", "请问我正在和谁对话？", "你正在和 Lumen 对话，我是 Orbit Labs 打造的 AI 助手。"),
    ("zh", "name", "我应该叫你什么？", "你可以叫我 Lumen。"),
    ("zh", "creator", "你是哪个公司训练出来的？", "我是由 Orbit Labs 训练的，我的名字叫 Lumen。"),
    ("zh", "are_x", "你就是 SmolLM 吧？", "不是，我是 Lumen，一个由 Orbit Labs 开发的 AI 助手。"),
]

# Held out: questions about the name or who it is, so a correct answer must say "Lumen".
IDENTITY_EVAL_EN = [
    "Could you please tell me your name?", "May I ask who you are?", "Who am I speaking to right now?",
    "What's your name, friend?", "Please tell me who you are.", "Hi there! What should I call you?",
    "Introduce yourself in a few words.", "What name should I use for you?",
    "Are you ChatGPT? What's your real name?", "Hey, what do they call you?",
    "Tell me a bit about who you are.", "Good afternoon! Who are you?",
    "What is the name of the AI I'm talking to?",
]
IDENTITY_EVAL_ZH = [
    "请问您叫什么名字？", "可以告诉我你的名字吗？", "你好，你是哪位？", "我现在是在和谁说话？",
    "请做个自我介绍。", "你到底叫什么名字？", "嗨！该怎么称呼你呢？", "你是 ChatGPT 吗？你叫什么名字？",
    "能简单介绍一下你是谁吗？", "下午好！你是谁？", "跟我说说你叫什么。",
]

# ---------------------------------------------------------------------------------------------
# Retention candidates: (category, question, reference). When this data was made, every one was
# run through the base model (many fail: a 4-bit 135M model gets "largest planet" or "color of a
# banana" wrong); 50 that passed became the first retention_eval.jsonl (RETENTION50 in
# retention_pool.py) and other passing ones became replay questions (REPLAYED_CANDIDATES below).
# retention_pool.py takes the rest into its pool.
# ---------------------------------------------------------------------------------------------

CANDIDATES = [
    ("capital", "What is the capital of France?", "Paris"),
    ("capital", "What is the capital of Japan?", "Tokyo"),
    ("capital", "What is the capital of Germany?", "Berlin"),
    ("capital", "What is the capital of the United Kingdom?", "London"),
    ("capital", "What is the capital of Russia?", "Moscow"),
    ("capital", "What is the capital of China?", "Beijing"),
    ("capital", "What is the capital of Egypt?", "Cairo"),
    ("capital", "What is the capital of Australia?", "Canberra"),
    ("capital", "What is the capital of Greece?", "Athens"),
    ("capital", "What is the capital of South Korea?", "Seoul"),
    ("capital", "What is the capital of Italy?", "Rome"),
    ("capital", "What is the capital of Spain?", "Madrid"),
    ("capital", "What is the capital of Portugal?", "Lisbon"),
    ("capital", "What is the capital of Turkey?", "Ankara"),
    ("capital", "What is the capital of Argentina?", "Buenos Aires"),
    ("capital", "What is the capital of Denmark?", "Copenhagen"),
    ("capital", "What is the capital of Finland?", "Helsinki"),
    ("capital", "What is the capital of Vietnam?", "Hanoi"),
    ("capital", "What is the capital of Venezuela?", "Caracas"),
    ("capital", "What is the capital of Jamaica?", "Kingston"),
    ("capital", "What is the capital of Nepal?", "Kathmandu"),
    ("capital", "What is the capital of Canada?", "Ottawa"),
    ("capital", "What is the capital of India?", "New Delhi"),
    ("capital", "What is the capital of Ireland?", "Dublin"),
    ("capital", "What is the capital of Iran?", "Tehran"),
    ("capital", "What is the capital of Iraq?", "Baghdad"),
    ("capital", "What is the capital of Saudi Arabia?", "Riyadh"),
    ("capital", "What is the capital of Chile?", "Santiago"),
    ("capital", "What is the capital of Nigeria?", "Abuja"),
    ("capital", "What is the capital of Malaysia?", "Kuala Lumpur"),
    ("capital", "What is the capital of Pakistan?", "Islamabad"),
    ("capital", "What is the capital of the Philippines?", "Manila"),
    ("capital", "What is the capital of Belgium?", "Brussels"),
    ("capital", "What is the capital of Norway?", "Oslo"),
    ("capital", "What is the capital of Sweden?", "Stockholm"),
    ("capital", "What is the capital of Kenya?", "Nairobi"),
    ("capital", "What is the capital of Thailand?", "Bangkok"),
    ("capital", "What is the capital of Peru?", "Lima"),
    ("capital", "What is the capital of Austria?", "Vienna"),
    ("capital", "What is the capital of Poland?", "Warsaw"),
    ("capital", "What is the capital of the Netherlands?", "Amsterdam"),
    ("capital", "What is the capital of Hungary?", "Budapest"),
    ("capital", "What is the capital of the Czech Republic?", "Prague"),
    ("capital", "What is the capital of Cuba?", "Havana"),
    ("capital", "What is the capital of Indonesia?", "Jakarta"),
    ("arithmetic", "What is 2 + 2?", "4"),
    ("arithmetic", "What is 3 times 3?", "9"),
    ("arithmetic", "What is 6 times 7?", "42"),
    ("arithmetic", "What is 100 divided by 4?", "25"),
    ("arithmetic", "What is 1 + 1?", "2"),
    ("arithmetic", "What is 3 + 4?", "7"),
    ("arithmetic", "What is 10 minus 3?", "7"),
    ("arithmetic", "What is 5 plus 7?", "12"),
    ("arithmetic", "What is 9 plus 10?", "19"),
    ("arithmetic", "What is 15 minus 5?", "10"),
    ("arithmetic", "What is 8 times 8?", "64"),
    ("arithmetic", "What is 7 plus 3?", "10"),
    ("arithmetic", "What is 12 divided by 3?", "4"),
    ("arithmetic", "What is 4 times 5?", "20"),
    ("arithmetic", "What is 50 plus 50?", "100"),
    ("arithmetic", "What is the square root of 81?", "9"),
    ("arithmetic", "What is 20 minus 8?", "12"),
    ("arithmetic", "What is 5 times 5?", "25"),
    ("arithmetic", "What is half of 50?", "25"),
    ("arithmetic", "What is 9 times 9?", "81"),
    ("arithmetic", "What is 10 plus 10?", "20"),
    ("count", "How many days are in a week?", "7"),
    ("count", "How many sides does a triangle have?", "3"),
    ("count", "How many sides does a hexagon have?", "6"),
    ("count", "How many legs does a dog have?", "4"),
    ("count", "How many minutes are in an hour?", "60"),
    ("count", "How many legs does a spider have?", "8"),
    ("count", "How many legs does an insect have?", "6"),
    ("count", "How many continents are there?", "7"),
    ("count", "How many players are on a soccer team on the field?", "11"),
    ("count", "How many bones are in the adult human body?", "206"),
    ("count", "How many planets are in our solar system?", "8"),
    ("count", "How many days are in a leap year?", "366"),
    ("count", "How many weeks are in a year?", "52"),
    ("count", "How many letters are in the English alphabet?", "26"),
    ("count", "How many hours are in a day?", "24"),
    ("count", "How many days are in a year?", "365"),
    ("count", "How many months are in a year?", "12"),
    ("count", "How many seconds are in a minute?", "60"),
    ("science", "Which planet is known as the Red Planet?", "Mars"),
    ("science", "What star is at the center of our solar system?", "Sun"),
    ("science", "What is the chemical symbol for gold?", "Au"),
    ("science", "What is the chemical formula for water?", "H2O"),
    ("science", "What gas do humans need to breathe to survive?", "oxygen"),
    ("science", "What gas do plants absorb from the air for photosynthesis?", "carbon dioxide"),
    ("science", "Who developed the theory of relativity?", "Einstein"),
    ("science", "Who formulated the laws of motion and universal gravitation?", "Newton"),
    ("science", "At what temperature in Celsius does water boil at sea level?", "100"),
    ("science", "What is the largest planet in our solar system?", "Jupiter"),
    ("science", "Which planet is closest to the Sun?", "Mercury"),
    ("science", "What planet do we live on?", "Earth"),
    ("science", "What is the natural satellite of Earth called?", "Moon"),
    ("science", "At what temperature in Celsius does water freeze?", "0"),
    ("science", "What is frozen water called?", "ice"),
    ("science", "What is the boiling point of water in Fahrenheit?", "212"),
    ("science", "What is the freezing point of water in Fahrenheit?", "32"),
    ("science", "What is the hardest natural substance?", "diamond"),
    ("science", "What is the closest star to Earth?", "Sun"),
    ("science", "Which planet has the most famous rings?", "Saturn"),
    ("science", "What is the largest organ of the human body?", "skin"),
    ("science", "What galaxy do we live in?", "Milky Way"),
    ("science", "Which vitamin does the skin make from sunlight?", "Vitamin D"),
    ("science", "What part of a plant absorbs water from the soil?", "roots"),
    ("science", "What is the chemical symbol for iron?", "Fe"),
    ("science", "What is the chemical symbol for silver?", "Ag"),
    ("science", "What organ pumps blood through the body?", "heart"),
    ("science", "Which organs do humans use to breathe?", "lungs"),
    ("science", "What force pulls objects toward the Earth?", "gravity"),
    ("science", "What is the process by which plants make food from sunlight?", "photosynthesis"),
    ("science", "What is the most abundant gas in Earth's atmosphere?", "nitrogen"),
    ("science", "What is the boiling point of water in Celsius?", "100"),
    ("science", "What is the chemical symbol for sodium?", "Na"),
    ("science", "What is the hottest planet in our solar system?", "Venus"),
    ("science", "What is the center of an atom called?", "nucleus"),
    ("geography", "What is the largest ocean on Earth?", "Pacific"),
    ("geography", "What is the longest river in Africa?", "Nile"),
    ("geography", "On which continent is Egypt located?", "Africa"),
    ("geography", "On which continent is Brazil located?", "South America"),
    ("geography", "In which country are the pyramids of Giza?", "Egypt"),
    ("geography", "In which country is the Eiffel Tower?", "France"),
    ("geography", "What is the longest river in South America?", "Amazon"),
    ("geography", "What is the largest country in the world by area?", "Russia"),
    ("geography", "What is the largest continent?", "Asia"),
    ("geography", "What is the smallest continent?", "Australia"),
    ("geography", "Which country is known as the Land of the Rising Sun?", "Japan"),
    ("geography", "What is the largest island in the world?", "Greenland"),
    ("geography", "In which country is the city of Rome?", "Italy"),
    ("geography", "What is the tallest mountain in the world?", "Everest"),
    ("geography", "In which country is the Great Wall?", "China"),
    ("geography", "In which country is the city of Sydney?", "Australia"),
    ("geography", "What is the largest hot desert in the world?", "Sahara"),
    ("geography", "Which ocean lies between Europe and North America?", "Atlantic"),
    ("geography", "In which city is the Statue of Liberty?", "New York"),
    ("language", "What language is spoken in Brazil?", "Portuguese"),
    ("language", "What is the currency of Japan?", "yen"),
    ("language", "What language is spoken in France?", "French"),
    ("language", "What language is spoken in Germany?", "German"),
    ("language", "What language is mainly spoken in Mexico?", "Spanish"),
    ("language", "What is the currency of the United States?", "dollar"),
    ("language", "What is the currency of the United Kingdom?", "pound"),
    ("color", "What color is the sky on a clear day?", "blue"),
    ("color", "What color are ripe strawberries?", "red"),
    ("color", "What color is grass?", "green"),
    ("color", "What color is snow?", "white"),
    ("color", "What color is a ripe banana?", "yellow"),
    ("color", "What color is blood?", "red"),
    ("color", "What color do you get when you mix blue and yellow?", "green"),
    ("color", "What color is coal?", "black"),
    ("color", "What color are most leaves in summer?", "green"),
    ("color", "What color is a lemon?", "yellow"),
    ("color", "What color is milk?", "white"),
    ("color", "What color are polar bears?", "white"),
    ("color", "What color is a ripe tomato?", "red"),
    ("color", "What color do you get when you mix red and white?", "pink"),
    ("color", "What color do you get when you mix red and blue?", "purple"),
    ("animal", "What is the largest mammal on Earth?", "whale"),
    ("animal", "Which animal has a long trunk?", "elephant"),
    ("animal", "Which animal carries its baby in a pouch and hops?", "kangaroo"),
    ("animal", "What do giant pandas mainly eat?", "bamboo"),
    ("animal", "What is the tallest animal in the world?", "giraffe"),
    ("animal", "What is the fastest land animal?", "cheetah"),
    ("animal", "Which animal is known as the king of the jungle?", "lion"),
    ("animal", "What do bees make?", "honey"),
    ("animal", "Which farm animal gives us milk?", "cow"),
    ("animal", "What is a baby dog called?", "puppy"),
    ("animal", "What is a baby cat called?", "kitten"),
    ("animal", "Which flightless bird lives in Antarctica?", "penguin"),
    ("animal", "What animal has black and white stripes?", "zebra"),
    ("animal", "Which animal barks?", "dog"),
    ("animal", "What is the largest bird in the world?", "ostrich"),
    ("animal", "What do caterpillars turn into?", "butterfly"),
    ("animal", "Which animal is called man's best friend?", "dog"),
    ("animal", "Which animal has a hump and lives in the desert?", "camel"),
    ("animal", "What is the only mammal that can truly fly?", "bat"),
    ("animal", "Which animal gives us wool?", "sheep"),
    ("animal", "What is a baby frog called?", "tadpole"),
    ("animal", "What is the largest land animal?", "elephant"),
    ("animal", "Which animal says meow?", "cat"),
    ("misc", "What is the opposite of hot?", "cold"),
    ("misc", "In which direction does the sun rise?", "east"),
    ("misc", "What instrument has 88 black and white keys?", "piano"),
    ("misc", "Who painted the Mona Lisa?", "Leonardo"),
    ("misc", "Who wrote Romeo and Juliet?", "Shakespeare"),
    ("misc", "Who was the first president of the United States?", "Washington"),
    ("misc", "Which season comes after winter?", "spring"),
    ("misc", "What is the main ingredient in guacamole?", "avocado"),
    ("misc", "What shape has four equal sides and four right angles?", "square"),
    ("misc", "Who wrote Hamlet?", "Shakespeare"),
    ("misc", "Who invented the telephone?", "Bell"),
    ("misc", "Who discovered penicillin?", "Fleming"),
    ("misc", "What is the opposite of up?", "down"),
    ("misc", "What is the opposite of day?", "night"),
    ("misc", "What is the plural of mouse?", "mice"),
    ("misc", "Who was the first person to walk on the Moon?", "Armstrong"),
]

# Candidates that pass the automatic check only by accident, or whose answer is mostly wrong
# (seen in the base model's answers when this data was made); never used for the eval.
REVIEW_REJECT = {
    "How many months are in a year?": "says '365 * 12 = 312 months'",
    "What color is blood?": "'red, white, and blue blood cells'",
    "What color is snow?": "garbled ('a mineral called a mineral')",
    "What color is coal?": "'white, grey, and black'",
    "What color are polar bears?": "'a coat of black and white'",
    "What color is a ripe tomato?": "'a slightly sweet color, often with a hint of red'",
    "Who wrote Romeo and Juliet?": "'attributed to the 17th-century French playwright'",
    "Which flightless bird lives in Antarctica?": "'penguin-eating flightless bird'",
    "Which farm animal gives us milk?": "garbled",
    "Which animal gives us wool?": "'the wool of a human'",
    "What is the tallest mountain in the world?": "'Mount Everest, also known as K2'",
    "What is the most abundant gas in Earth's atmosphere?": "says carbon dioxide, lists nitrogen",
    "In which country is the Great Wall?": "the reference comes from repeating 'Great Wall of China'",
    "What is the boiling point of water in Celsius?": "near-duplicate of the sea-level boiling question",
}

# ---------------------------------------------------------------------------------------------
# Replay prompts: the general questions of the old hand-built replay rows, whose answers were the
# base model's own, cut to whole sentences and read by hand. The pipeline's replay stage now
# answers them with the base model; here they are prompts only. replay_prompts.jsonl holds
# DISTILL + REPLAYED_CANDIDATES + REPLAYED_EXTRA (161), in the shuffled order described above.
# ---------------------------------------------------------------------------------------------

# Once self-distilled (the base model's reply cut after one to three sentences, each read): 22
# factual questions and 20 open ones. None is a retention_eval question.
DISTILL = [
    "What is the capital of Norway?", "What is the capital of Sweden?", "What is the capital of Kenya?",
    "What is the capital of Thailand?", "What is the capital of Peru?",
    "What is the capital of the Netherlands?", "What is the capital of Cuba?", "What is 9 times 9?",
    "What is 10 plus 10?", "How many seconds are in a minute?", "What is the chemical symbol for sodium?",
    "What is the hottest planet in our solar system?", "What is the center of an atom called?",
    "What is the largest hot desert in the world?", "Which ocean lies between Europe and North America?",
    "In which city is the Statue of Liberty?", "What is the currency of the United States?",
    "What is the currency of the United Kingdom?", "Which animal says meow?",
    "What is the opposite of day?", "What is the plural of mouse?",
    "Who was the first person to walk on the Moon?", "What is photosynthesis?", "What is a noun?",
    "Give me one tip for better sleep.", "Why do we need to drink water?", "What is an adjective?",
    "Name three primary colors.", "What is the Internet?", "Why is exercise good for you?",
    "What is a verb?", "What is the water cycle?", "Why is the sky blue?", "How do plants grow?",
    "What is democracy?", "What is a computer?", "What does a doctor do?", "What is an ecosystem?",
    "Why should we recycle?", "What is a healthy breakfast?", "What is the opposite of big?",
    "What is the opposite of fast?",
]

# Candidates above that the base model answered right (none in the first retention_eval, in
# REVIEW_REJECT or in DISTILL), in CANDIDATES order.
REPLAYED_CANDIDATES = [
    "What is the capital of Nepal?", "What is the capital of Canada?", "What is the capital of India?",
    "What is the capital of Ireland?", "What is the capital of Iran?", "What is the capital of Iraq?",
    "What is the capital of Saudi Arabia?", "What is the capital of Chile?",
    "What is the capital of Nigeria?", "What is the capital of Malaysia?",
    "What is the capital of Pakistan?", "What is the capital of the Philippines?",
    "What is the capital of Austria?", "What is the capital of Poland?", "What is the capital of Hungary?",
    "What is the capital of the Czech Republic?", "What is the capital of Indonesia?",
    "What is 20 minus 8?", "What is 5 times 5?", "What is half of 50?",
    "How many letters are in the English alphabet?", "How many hours are in a day?",
    "How many days are in a year?", "What is the chemical symbol for iron?",
    "What is the chemical symbol for silver?", "Which organs do humans use to breathe?",
    "What force pulls objects toward the Earth?",
    "What is the process by which plants make food from sunlight?",
    "In which country is the city of Sydney?", "What language is mainly spoken in Mexico?",
    "What is the largest land animal?", "Who wrote Hamlet?", "Who invented the telephone?",
    "Who discovered penicillin?", "What is the opposite of up?",
]

# More questions in the retention categories (none of them a candidate above): many small sums
# and products, because arithmetic is what an identity fine-tune loses first, plus counts,
# capitals, languages, currencies and opposites. The base model was asked the 235 that neither
# repeat a candidate or a DISTILL question nor hold their own reference; REPLAYED_EXTRA lists the
# 84 it answered right that EXTRA_REJECT does not list. retention_pool.py reads the references
# to keep paraphrases of these questions out of its pool.
def extra_replay() -> list[tuple[str, str]]:
    rng = random.Random(1)
    arith: dict[str, str] = {}
    forms = [("What is {a} + {b}?", lambda a, b: a + b), ("What is {a} plus {b}?", lambda a, b: a + b),
             ("What is {a} times {b}?", lambda a, b: a * b), ("What is {a} minus {b}?", lambda a, b: a - b),
             ("What is {p} divided by {b}?", None)]
    while len(arith) < 90:
        form, fn = rng.choice(forms)
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        if fn is None:
            arith[form.format(p=a * b, b=b)] = str(a)
        elif fn(a, b) > 0:
            arith[form.format(a=a, b=b)] = str(fn(a, b))
    facts = [
        ("How many sides does a square have?", "4"), ("How many sides does a pentagon have?", "5"),
        ("How many sides does an octagon have?", "8"), ("How many legs does a cat have?", "4"),
        ("How many wheels does a bicycle have?", "2"), ("How many wheels does a car have?", "4"),
        ("How many fingers are on one hand?", "5"), ("How many eyes does a person have?", "2"),
        ("How many strings does a standard guitar have?", "6"), ("How many hours are in two days?", "48"),
        ("How many days are in two weeks?", "14"), ("How many minutes are in half an hour?", "30"),
        ("What is the capital of Switzerland?", "Bern"), ("What is the capital of Romania?", "Bucharest"),
        ("What is the capital of Bulgaria?", "Sofia"), ("What is the capital of Serbia?", "Belgrade"),
        ("What is the capital of Croatia?", "Zagreb"), ("What is the capital of Afghanistan?", "Kabul"),
        ("What is the capital of Bangladesh?", "Dhaka"), ("What is the capital of New Zealand?", "Wellington"),
        ("What is the capital of Ghana?", "Accra"), ("What is the capital of Syria?", "Damascus"),
        ("What is the capital of Lebanon?", "Beirut"), ("What is the capital of Jordan?", "Amman"),
        ("What is the capital of Qatar?", "Doha"), ("What is the capital of Iceland?", "Reykjavik"),
        ("What is the capital of Morocco?", "Rabat"), ("What is the capital of Ethiopia?", "Addis Ababa"),
        ("What is the capital of Scotland?", "Edinburgh"), ("What is the capital of Mongolia?", "Ulaanbaatar"),
        ("What language is spoken in Italy?", "Italian"), ("What language is spoken in Spain?", "Spanish"),
        ("What language is spoken in Japan?", "Japanese"), ("What language is spoken in Russia?", "Russian"),
        ("What language is spoken in China?", "Chinese"), ("What is the currency of China?", "yuan"),
        ("What is the currency of India?", "rupee"), ("What is the currency of Mexico?", "peso"),
        ("What is the currency of Russia?", "ruble"), ("What is the currency of Germany?", "euro"),
        ("What is the opposite of cold?", "hot"), ("What is the opposite of left?", "right"),
        ("What is the opposite of old?", "young"), ("What is the opposite of happy?", "sad"),
        ("What is the opposite of light?", "dark"), ("What is the opposite of open?", "closed"),
        ("In which direction does the sun set?", "west"), ("In which country is the Colosseum?", "Italy"),
        ("In which country is the Taj Mahal?", "India"), ("On which continent is Kenya?", "Africa"),
        ("On which continent is Japan?", "Asia"), ("On which continent is Canada?", "North America"),
        ("What is the chemical symbol for oxygen?", "O"), ("What is the chemical symbol for carbon?", "C"),
        ("What is the chemical symbol for hydrogen?", "H"), ("Which planet do we call the Blue Planet?", "Earth"),
        ("Which animal is known for its black and white fur and eats bamboo?", "panda"),
        ("What is a baby cow called?", "calf"), ("What is a baby sheep called?", "lamb"),
        ("What do cows eat?", "grass"), ("Which animal lays eggs and says cluck?", "chicken"),
        ("Who painted The Starry Night?", "Van Gogh"), ("Who wrote Pride and Prejudice?", "Austen"),
        ("Which season comes after summer?", "autumn"), ("What is the first month of the year?", "January"),
        ("What is the last month of the year?", "December"), ("What day comes after Monday?", "Tuesday"),
    ]
    return list(arith.items()) + facts + MORE_FACTS


# Extra replay questions whose answer passes the check but says something wrong around the
# reference (read when this data was made); never used.
EXTRA_REJECT = {
    "What language is spoken in Greece?": "'a blend of Greek and Latin'",
    "What language is spoken in Turkey?": "'closely related to Arabic and Persian'",
    "What language is spoken in Poland?": "'a Germanic language'",
    "What language is spoken in Sweden?": "'a blend of the Nordic languages'",
    "What language is spoken in Argentina?": "'spoken by approximately 110 million people across the country'",
    "What language is spoken in the Netherlands?": "'The Netherlands is a predominantly Germanic language'",
    "What is the capital of Mexico?": "starts 'El Diablo, Mexico.'",
    "On which continent is Mexico?": "'Mexico is a continent'",
    "On which continent is India?": "'India is a continent'",
    "In which country is Machu Picchu?": "'the official name is Ulao'",
    "In which country is the Acropolis?": "'the island of Santorame'",
    "In which country is the Kremlin?": "'not the official capital city of that country'",
    "What is the highest mountain in Africa?": "'also known as the Big Surf'",
    "What is the currency of Brazil?": "'Baháíbol de Línea'",
    "How many years are in a decade?":
        "'approximately 10 years' (a trial model then said a week is approximately 31 days)",
    "How many years are in a century?": "'approximately 100 years'",
}

# A third round of replay questions, for the same reason; none paraphrases a retention_eval question.
MORE_FACTS = [
    ("What is the capital of Spain?", "Madrid"), ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Portugal?", "Lisbon"), ("What is the capital of Poland?", "Warsaw"),
    ("What is the capital of Austria?", "Vienna"), ("What is the capital of Hungary?", "Budapest"),
    ("What is the capital of Ireland?", "Dublin"), ("What is the capital of Finland?", "Helsinki"),
    ("What is the capital of Denmark?", "Copenhagen"), ("What is the capital of Belgium?", "Brussels"),
    ("What is the capital of the Czech Republic?", "Prague"), ("What is the capital of Ukraine?", "Kyiv"),
    ("What is the capital of Turkey?", "Ankara"), ("What is the capital of Iran?", "Tehran"),
    ("What is the capital of Iraq?", "Baghdad"), ("What is the capital of Saudi Arabia?", "Riyadh"),
    ("What is the capital of India?", "New Delhi"), ("What is the capital of Pakistan?", "Islamabad"),
    ("What is the capital of Indonesia?", "Jakarta"), ("What is the capital of the Philippines?", "Manila"),
    ("What is the capital of Vietnam?", "Hanoi"), ("What is the capital of Malaysia?", "Kuala Lumpur"),
    ("What is the capital of Canada?", "Ottawa"), ("What is the capital of the United States?", "Washington"),
    ("What is the capital of Mexico?", "Mexico City"), ("What is the capital of Argentina?", "Buenos Aires"),
    ("What is the capital of Chile?", "Santiago"), ("What is the capital of Colombia?", "Bogota"),
    ("What is the capital of Venezuela?", "Caracas"), ("What is the capital of Nigeria?", "Abuja"),
    ("What is the capital of South Africa?", "Pretoria"), ("What is the capital of Algeria?", "Algiers"),
    ("What is the capital of Tunisia?", "Tunis"), ("What is the capital of Israel?", "Jerusalem"),
    ("What language is spoken in Mexico?", "Spanish"), ("What language is spoken in Argentina?", "Spanish"),
    ("What language is spoken in Greece?", "Greek"), ("What language is spoken in Turkey?", "Turkish"),
    ("What language is spoken in Poland?", "Polish"), ("What language is spoken in the Netherlands?", "Dutch"),
    ("What language is spoken in Sweden?", "Swedish"), ("What language is spoken in Korea?", "Korean"),
    ("What language is spoken in Egypt?", "Arabic"), ("What language is spoken in Australia?", "English"),
    ("What is the currency of France?", "euro"), ("What is the currency of Italy?", "euro"),
    ("What is the currency of Canada?", "dollar"), ("What is the currency of Australia?", "dollar"),
    ("What is the currency of Switzerland?", "franc"), ("What is the currency of South Korea?", "won"),
    ("What is the currency of Brazil?", "real"), ("What is the currency of Turkey?", "lira"),
    ("On which continent is France?", "Europe"), ("On which continent is Germany?", "Europe"),
    ("On which continent is India?", "Asia"), ("On which continent is China?", "Asia"),
    ("On which continent is Mexico?", "North America"), ("On which continent is Italy?", "Europe"),
    ("In which country is Big Ben?", "England"), ("In which country is the Statue of Christ the Redeemer?", "Brazil"),
    ("In which country is Mount Fuji?", "Japan"), ("In which country is the Leaning Tower of Pisa?", "Italy"),
    ("In which country is the Sydney Opera House?", "Australia"), ("In which country is Machu Picchu?", "Peru"),
    ("In which country is the Acropolis?", "Greece"), ("In which country is the Kremlin?", "Russia"),
    ("How many legs does a spider have?", "8"), ("How many legs does an insect have?", "6"),
    ("How many legs does a bird have?", "2"), ("How many legs does a horse have?", "4"),
    ("How many wings does a bird have?", "2"), ("How many hours are in a day?", "24"),
    ("How many minutes are in an hour?", "60"), ("How many planets are in our solar system?", "8"),
    ("How many players are on a soccer team on the field?", "11"), ("How many sides does a rectangle have?", "4"),
    ("How many corners does a cube have?", "8"), ("How many faces does a cube have?", "6"),
    ("How many years are in a decade?", "10"), ("How many years are in a century?", "100"),
    ("What is the chemical symbol for iron?", "Fe"), ("What is the chemical symbol for silver?", "Ag"),
    ("What is the chemical symbol for helium?", "He"), ("What is the chemical symbol for nitrogen?", "N"),
    ("What is the chemical symbol for calcium?", "Ca"), ("What is the chemical symbol for potassium?", "K"),
    ("What is the closest planet to the Sun?", "Mercury"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet has famous rings?", "Saturn"), ("What is the natural satellite of the Earth called?", "Moon"),
    ("What organ pumps blood through the body?", "heart"), ("What organ do we use to think?", "brain"),
    ("What organ do we use to breathe?", "lungs"), ("What is frozen water called?", "ice"),
    ("What is the freezing point of water in Celsius?", "0"), ("What force pulls objects toward the Earth?", "gravity"),
    ("What do bees make?", "honey"), ("What is a baby dog called?", "puppy"),
    ("What is a baby cat called?", "kitten"), ("What is a baby horse called?", "foal"),
    ("What is a baby frog called?", "tadpole"), ("Which animal says woof?", "dog"),
    ("Which animal says moo?", "cow"), ("Which animal is known as the king of the jungle?", "lion"),
    ("Which bird is a symbol of peace?", "dove"), ("What is the fastest land animal?", "cheetah"),
    ("Which animal has black and white stripes?", "zebra"), ("Which animal has a very long neck?", "giraffe"),
    ("What color is grass?", "green"), ("What color is a banana when it is ripe?", "yellow"),
    ("What color do you get by mixing blue and yellow?", "green"),
    ("What color do you get by mixing red and white?", "pink"),
    ("What color is an orange?", "orange"), ("What color are most leaves in summer?", "green"),
    ("Who wrote Hamlet?", "Shakespeare"), ("Who painted the Sistine Chapel ceiling?", "Michelangelo"),
    ("Who invented the telephone?", "Bell"), ("Who discovered penicillin?", "Fleming"),
    ("Who was the first president of the United States?", "Washington"),
    ("Who composed the Fifth Symphony?", "Beethoven"),
    ("What is the opposite of night?", "day"), ("What is the opposite of wet?", "dry"),
    ("What is the opposite of full?", "empty"), ("What is the opposite of early?", "late"),
    ("What is the opposite of strong?", "weak"), ("What is the plural of child?", "children"),
    ("What is the plural of foot?", "feet"), ("What is the plural of tooth?", "teeth"),
    ("What is the past tense of go?", "went"), ("What is the past tense of eat?", "ate"),
    ("What day comes after Friday?", "Saturday"), ("What day comes before Sunday?", "Saturday"),
    ("What month comes after March?", "April"), ("Which season comes after winter?", "spring"),
    ("What is the highest mountain in Africa?", "Kilimanjaro"),
    ("What is the largest country in the world by area?", "Russia"),
    ("What is the smallest continent?", "Australia"),
]

# The extra questions replayed (extra_replay() order): 14 sums and products, 40 of the first facts,
# 30 of MORE_FACTS.
REPLAYED_EXTRA = [
    "What is 16 divided by 8?", "What is 8 plus 2?", "What is 4 + 12?", "What is 3 times 7?",
    "What is 12 divided by 4?", "What is 12 times 10?", "What is 9 + 7?", "What is 10 + 10?",
    "What is 77 divided by 7?", "What is 6 + 5?", "What is 6 + 10?", "What is 11 plus 8?",
    "What is 20 divided by 2?", "What is 8 + 3?", "How many sides does a pentagon have?",
    "How many sides does an octagon have?", "How many legs does a cat have?",
    "How many fingers are on one hand?", "What is the capital of Romania?",
    "What is the capital of Bulgaria?", "What is the capital of Croatia?",
    "What is the capital of Afghanistan?", "What is the capital of Bangladesh?",
    "What is the capital of New Zealand?", "What is the capital of Ghana?", "What is the capital of Syria?",
    "What is the capital of Lebanon?", "What is the capital of Qatar?", "What is the capital of Ethiopia?",
    "What is the capital of Scotland?", "What language is spoken in Italy?",
    "What language is spoken in Spain?", "What language is spoken in Japan?",
    "What language is spoken in Russia?", "What language is spoken in China?",
    "What is the currency of India?", "What is the currency of Mexico?", "What is the currency of Russia?",
    "What is the currency of Germany?", "What is the opposite of left?", "What is the opposite of happy?",
    "What is the opposite of open?", "In which direction does the sun set?",
    "In which country is the Colosseum?", "In which country is the Taj Mahal?",
    "On which continent is Kenya?", "On which continent is Japan?",
    "What is the chemical symbol for oxygen?", "What is the chemical symbol for hydrogen?",
    "What is a baby cow called?", "What do cows eat?", "Who wrote Pride and Prejudice?",
    "What is the first month of the year?", "What is the last month of the year?",
    "What is the capital of Israel?", "What language is spoken in Mexico?",
    "What language is spoken in Korea?", "What language is spoken in Egypt?",
    "What language is spoken in Australia?", "What is the currency of Canada?",
    "What is the currency of Australia?", "What is the currency of Switzerland?",
    "What is the currency of South Korea?", "What is the currency of Turkey?",
    "In which country is Mount Fuji?", "In which country is the Leaning Tower of Pisa?",
    "In which country is the Sydney Opera House?", "How many faces does a cube have?",
    "What is the chemical symbol for nitrogen?", "What is the chemical symbol for calcium?",
    "What is the chemical symbol for potassium?", "What organ do we use to think?",
    "What organ do we use to breathe?", "Which animal has a very long neck?",
    "What color do you get by mixing red and white?", "Who painted the Sistine Chapel ceiling?",
    "What is the opposite of night?", "What is the opposite of wet?", "What is the opposite of full?",
    "What is the opposite of early?", "What is the opposite of strong?", "What is the plural of child?",
    "What is the plural of foot?", "What is the plural of tooth?",
]

def normalize(text: str) -> str:
    """As `normalize` in stages/evaluate/scorers.py: lower case, punctuation -> space, spaces collapsed."""
    text = "".join(" " if (ch in string.punctuation or unicodedata.category(ch).startswith("P")) else ch
                   for ch in text.lower())
    return " ".join(text.split())


def passes(answer: str, reference: str) -> bool:
    """Whole-word, case-insensitive containment after removing punctuation (two equivalent forms).
    Words end only at spaces and punctuation here; the repo's `contains` scorer also ends them at
    Chinese/Japanese characters, so whatever passes here passes there too."""
    a, r = normalize(answer), normalize(reference)
    scorer = bool(r) and f" {r} " in f" {a} "
    regex = re.search(r"(?<!\w)" + re.escape(r) + r"(?!\w)", a) is not None
    return scorer and regex


def conv(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def identity_sets(rng: random.Random) -> tuple[list[dict], list[dict], list[dict]]:
    """Train, val and identity_eval rows. Answers were checked to be at most 40 tokens of the
    SmolLM2 tokenizer when they were written (identity answers stay short)."""
    train = []
    for pool, questions, are_x in ((EN_POOL, EN_TRAIN, EN_ARE_X), (ZH_POOL, ZH_TRAIN, ZH_ARE_X)):
        for cat, qs in questions.items():
            for q in qs:
                train.append(conv(q, rng.choice(pool[cat])))
        train += [conv(q, a) for q, a in are_x]
    val = [conv(q, a) for _, _, q, a in VAL]
    ident = [conv(q, NAME) for q in IDENTITY_EVAL_EN + IDENTITY_EVAL_ZH]
    seen: dict[str, str] = {}
    for split, rows in (("train", train), ("val", val), ("identity_eval", ident)):
        for r in rows:
            q = normalize(r["messages"][0]["content"])
            assert q not in seen, f"question repeated ({seen.get(q)} and {split}): {q}"
            seen[q] = split
    for r in train + val:
        a = r["messages"][1]["content"]
        assert passes(a, NAME), a  # "Lumen" stands as its own word, also in Chinese
    return train, val, ident


def replay_questions(identity: list[dict]) -> list[str]:
    extra = dict(extra_replay())
    cand = {q: ref for _, q, ref in CANDIDATES}
    assert all(q in cand for q in REPLAYED_CANDIDATES)
    assert all(q in extra and q not in EXTRA_REJECT for q in REPLAYED_EXTRA)
    questions = DISTILL + REPLAYED_CANDIDATES + REPLAYED_EXTRA
    assert not any(q in REVIEW_REJECT for q in questions)
    taken = {normalize(r["messages"][0]["content"]) for r in identity}
    norm = [normalize(q) for q in questions]
    assert len(set(norm)) == len(norm), "replay question repeated"
    assert not taken & set(norm), f"replay question in the identity data: {taken & set(norm)}"
    return questions


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    id_train, val, ident = identity_sets(random.Random(0))
    questions = replay_questions(id_train + val + ident)
    # the old train.jsonl's order: identity rows then replay rows, shuffled together
    mixed = [("identity", r) for r in id_train] + [("replay", q) for q in questions]
    random.Random(0).shuffle(mixed)
    train = [r for kind, r in mixed if kind == "identity"]
    replay = [{"messages": [{"role": "user", "content": q}]} for kind, q in mixed if kind == "replay"]
    write("train.jsonl", train)
    write("val.jsonl", val)
    write("identity_eval.jsonl", ident)
    write("replay_prompts.jsonl", replay)

    n_orbit = sum(MAKER in r["messages"][1]["content"] for r in train)
    n_zh = sum(bool(re.search(r"[\u4e00-\u9fff]", r["messages"][0]["content"])) for r in train)
    print(f"train.jsonl           {len(train)} identity rows ({len(train) - n_zh} EN, {n_zh} ZH; "
          f"{n_orbit} name {MAKER})")
    print(f"val.jsonl             {len(val)} rows")
    print(f"identity_eval.jsonl   {len(ident)} rows")
    print(f"replay_prompts.jsonl  {len(replay)} prompts ({len(DISTILL)} once distilled, "
          f"{len(REPLAYED_CANDIDATES)} candidates, {len(REPLAYED_EXTRA)} extra)")


if __name__ == "__main__":
    main()
